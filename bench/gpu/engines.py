"""Engines started as a TorchServe worker starts them (embedserve.handler.assembly.assemble), each
one's start-up time and device memory recorded; and peak-memory windows that survive the graph
runner's own resets of torch's one peak counter."""

from __future__ import annotations

from typing import Any

import gc
import time
from dataclasses import replace
from pathlib import Path

import torch

from embedserve.handler.assembly import assemble
from embedserve.handler.backends.cuda_graphs import release_memory
from embedserve.handler.execution.placement import available_cpus
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings


def graphs_of(backend) -> Any:
    """The CUDA graphs a backend replays (a GraphRunner or a PackedGraphRunner), or None."""
    return getattr(backend, "graphs", None)


class Bench:
    """Starts engines through the public entry points, as a TorchServe worker does, and records
    each one's start-up time, the device memory it holds and the most it held at once starting."""

    def __init__(self, device: str, overrides: dict, records: dict, memory: "PeakMemory"):
        self.device = device
        self.overrides = overrides
        self.records = records
        self.memory = memory

    def engine(self, name: str, model_dir: Path, *, unpadded: bool = False, warmup: bool = True,
               **settings) -> EmbeddingService:
        threads = {} if self.device == "cuda" else {"cpu_threads": available_cpus()}
        # Graphs and packed passes only where a mode asks (a GPU worker's default turns both on).
        config = Settings.from_mapping({"device": self.device, "engine": "torch", "cuda_graphs": False,
                                        "packed": False, **threads, **self.overrides, **settings})
        # The reference: no pad-to-multiple, so a one-text pass holds no padding at all.
        unpad = (lambda placement: replace(placement, pad_multiple=1)) if unpadded else None
        _sync(self.device)
        before = torch.cuda.memory_allocated() if self.device == "cuda" else 0
        window = self.memory.open()
        started = time.perf_counter()
        engine = assemble(model_dir, config, model_name="bench", cuda_available=torch.cuda.is_available(),
                          warm=warmup, adjust_placement=unpad)
        _sync(self.device)
        record = {"startup_s": round(time.perf_counter() - started, 3),
                  "pass_overhead_tokens": getattr(engine.encoder, "pass_overhead_tokens", None)}
        startup_peak = self.memory.close(window)
        if self.device == "cuda":
            record["resident_mib"] = round((torch.cuda.memory_allocated() - before) / 2**20, 1)
            record["startup_peak_mib"] = mib(startup_peak)
        runner = graphs_of(engine.encoder.backend)
        if runner is not None:
            record["graphs_captured"] = len(runner.graphs)
        self.records[name] = record
        return engine


class PeakMemory:
    """The most device memory allocated at once within a window (an engine's start-up, a model's
    whole run). torch keeps one peak counter, and embedserve/handler/backends/cuda_graphs.py resets it before each
    bucket's warm-up to size that bucket: read at a window's end, the counter would hold only what
    followed the last reset. While active, every reset first folds the counter into each open
    window, so a window's peak is the largest over its stretches between resets.

    `cuda` is torch.cuda (or a stand-in with max_memory_allocated and reset_peak_memory_stats);
    None measures nothing (CPU): open and close return None."""

    RESET = "reset_peak_memory_stats"

    def __init__(self, cuda=None, modules: tuple = ()):
        self.cuda = cuda
        # Every module a caller may reach the reset through: torch.cuda and torch.cuda.memory.
        self.modules = modules or tuple(m for m in (cuda, getattr(cuda, "memory", None)) if m is not None)
        self.windows: dict[int, int] = {}
        self.patched: list[tuple[object, object]] = []
        self.original = getattr(cuda, self.RESET, None)
        self.opened = 0

    def __enter__(self) -> "PeakMemory":
        for module in self.modules:
            if hasattr(module, self.RESET):
                self.patched.append((module, getattr(module, self.RESET)))
                setattr(module, self.RESET, self._reset)
        return self

    def __exit__(self, *exc) -> None:
        for module, original in reversed(self.patched):
            setattr(module, self.RESET, original)
        self.patched.clear()

    def open(self) -> int | None:
        if self.cuda is None:
            return None
        self._reset()  # the window's first stretch starts here; open windows keep what came before
        self.opened += 1
        self.windows[self.opened] = 0
        return self.opened

    def close(self, window: int | None) -> int | None:
        """The window's peak in bytes, or None when nothing is measured."""
        if window is None:
            return None
        return max(self.windows.pop(window), self.cuda.max_memory_allocated())

    def _reset(self, device=None, *args, **kwargs) -> None:
        peak = self.cuda.max_memory_allocated(device)
        for window, highest in self.windows.items():
            self.windows[window] = max(highest, peak)
        self.original(device, *args, **kwargs)


def mib(size: int | None) -> float | None:
    return None if size is None else round(size / 2**20, 1)


def release(cuda: bool) -> None:
    """Drop what the engines held. Through the handler's own release_memory, never empty_cache
    directly: after a failed capture empty_cache can trip the allocator's assert."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        release_memory(torch.device("cuda", torch.cuda.current_device()))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
