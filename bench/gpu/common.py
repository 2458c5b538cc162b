"""What every step of the GPU benchmark shares: the TorchServe batch it imitates, the names of
its modes, and its progress lines on stderr."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

import torch

TORCHSERVE_BATCH = 32  # the build's batchSize: requests per TorchServe batch
ST_BATCH_SIZES = (32, 256)  # sentence-transformers' default, and a large one
STARTED = time.perf_counter()
# torch's threads before any engine starts here. A GPU engine's placement sets its process to one
# (embedserve/handler/execution/placement.py, GPU_TORCH_THREADS); the libraries it is compared
# with run at torch's default, as their users run them.
DEFAULT_TORCH_THREADS = torch.get_num_threads()


def mode_name(dtype: str, graphs: bool) -> str:
    return f"{dtype}_{'graphs' if graphs else 'eager'}"


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


@contextmanager
def library_threads() -> Iterator[None]:
    """torch's default thread count for a reference library's run, the engines' count after it."""
    engines = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_TORCH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(engines)
