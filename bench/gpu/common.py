"""What every step of the GPU benchmark shares: the TorchServe batch it imitates, the names of
its modes, and its progress lines on stderr."""

from __future__ import annotations

import sys
import time

TORCHSERVE_BATCH = 32  # the build's batchSize: requests per TorchServe batch
ST_BATCH_SIZES = (32, 256)  # sentence-transformers' default, and a large one
STARTED = time.perf_counter()


def mode_name(dtype: str, graphs: bool) -> str:
    return f"{dtype}_{'graphs' if graphs else 'eager'}"


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)
