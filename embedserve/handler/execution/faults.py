"""Failures of a forward pass: which ones a worker survives, and the ones tests provoke.

Out of memory (CUDA's, the CPU allocator's own RuntimeError, MemoryError, ONNX Runtime's) is
survivable: the encoder splits the pass and retries. Any other CUDA error may have poisoned the
process's CUDA context, so it becomes DeviceFailure, for the worker to exit and be replaced.

The real-TorchServe tests provoke both in a real worker through EMBEDSERVE_TEST_FAULTS: the
composition root (embedserve/handler/assembly.py) then wraps the worker's backend in FaultInjectingBackend,
once warm-up has measured it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, NoReturn, Sequence

import torch

from embedserve.handler.backends.base import Backend, PassCost, PassInputs
from embedserve.handler.backends.onnx_runtime import is_out_of_memory as _onnx_out_of_memory

log = logging.getLogger(__name__)

FAULTS_ENV = "EMBEDSERVE_TEST_FAULTS"


class DeviceFailure(RuntimeError):
    """A CUDA error other than out-of-memory: the device state can no longer be trusted."""


def is_out_of_memory(err: BaseException) -> bool:
    # PyTorch's CPU allocator raises a RuntimeError of its own, not MemoryError.
    return isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)) or _onnx_out_of_memory(err) or (
        isinstance(err, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(err))


def is_device_failure(err: BaseException) -> bool:
    text = str(err)
    return "CUDA error" in text or "device-side assert" in text or type(err).__name__ == "AcceleratorError"


def raise_classified(err: Exception) -> NoReturn:
    """Raise `err` again: a CUDA error (other than out of memory) as DeviceFailure."""
    if is_device_failure(err):
        raise DeviceFailure(str(err)) from err
    raise err


@dataclass(frozen=True)
class FaultInjection:
    """Failures the tests provoke, e.g. "oom_above_tokens=64,device_error_token=7": a pass over
    64 padded tokens raises MemoryError; a pass holding token id 7 raises a CUDA-style device
    error. "device_pass_ms=5" makes every pass a stand-in GPU's (bench/overlap.py): it holds a
    lock that the server's workers share, as one device serializes their passes, and waits 5 ms
    there without using a CPU core, the way a host thread waits on a kernel."""
    oom_above_tokens: int = 0
    device_error_token: int = -1
    device_pass_ms: int = 0

    @classmethod
    def from_env(cls) -> "FaultInjection | None":
        spec = os.environ.get(FAULTS_ENV, "")
        if not spec:
            return None
        values = dict(item.split("=", 1) for item in spec.split(","))
        log.warning("%s is set: failures will be injected (%s); never set it in production", FAULTS_ENV, spec)
        return cls(**{key: int(value) for key, value in values.items()})

    def occupy_device(self) -> None:
        if self.device_pass_ms <= 0:
            return
        # TorchServe gives each server its own TMPDIR: the lock is shared by that server's workers.
        with open(os.path.join(tempfile.gettempdir(), "embedserve-standin-device.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                time.sleep(self.device_pass_ms / 1000)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def check(self, ids: torch.Tensor) -> None:
        if self.oom_above_tokens and ids.numel() > self.oom_above_tokens:
            raise MemoryError(f"injected: {ids.numel()} padded tokens > {self.oom_above_tokens}")
        if self.device_error_token >= 0 and bool((ids == self.device_error_token).any()):
            raise RuntimeError("CUDA error: device-side assert triggered (injected)")


class FaultInjectingBackend:
    """A backend whose passes first meet `faults`; everything else is the wrapped backend's."""

    def __init__(self, backend: Backend, faults: FaultInjection):
        self.backend = backend
        self.faults = faults
        self.device = backend.device

    def plan(self, lengths: Sequence[int], cost: PassCost) -> list[list[int]]:
        return self.backend.plan(lengths, cost)

    def prepare(self, rows: Sequence[Sequence[int]], unpooled: Sequence[int] | None,
                second: Sequence[int] | None = None) -> PassInputs:
        return self.backend.prepare(rows, unpooled, second)

    def run(self, inputs: PassInputs, *, eager: bool = False) -> torch.Tensor:
        self.faults.check(inputs.ids)
        self.faults.occupy_device()
        return self.backend.run(inputs, eager=eager)

    def computed_tokens(self, inputs: PassInputs) -> int:
        return self.backend.computed_tokens(inputs)

    def describe(self) -> dict[str, Any]:
        return self.backend.describe()
