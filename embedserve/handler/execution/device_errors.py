"""Failures of a forward pass: which ones a worker survives, and which ones end it.

Out of memory (CUDA's, the CPU allocator's own RuntimeError, MemoryError, ONNX Runtime's) is
survivable: the encoder splits the pass and retries. Any other CUDA error may have poisoned the
process's CUDA context, so it becomes DeviceFailure, for the worker to exit and be replaced.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from embedserve.handler.backends.onnx_runtime import is_out_of_memory as _onnx_out_of_memory


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
