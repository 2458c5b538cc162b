"""The faults the fault tests inject, in-process and in a real TorchServe worker, the texts they
send, and their answers in-process.

A worker meets them through tests/support/fault_entry.py, whose archive carries this module
(tests/support/serving.py, with_fault_entry): it imports nothing else of the tests.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from embedserve.handler.backends.base import Backend, PassCost, PassInputs
from embedserve.handler.api.exchange import RawRequest

log = logging.getLogger(__name__)

# The faults a worker started through fault_entry.py injects, e.g. "oom_above_tokens=64,device_error_token=7".
FAULTS_ENV = "EMBEDSERVE_TEST_FAULTS"

# The tiny model truncates at 48 tokens. Passes over 40 padded tokens "run out of memory": short
# texts fit after splitting, a 48-token input never fits, even alone.
OOM_ABOVE = 40
LONG = "embedding server batch request token text vector search query document " * 6  # cut at 48 tokens
SHORT = ["hello world", "the cat sat on the mat", "one two three", "a", "b c d", "hello", "cat mat", "world"]
POISON_TOKEN = 7


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
        log.warning("%s is set: failures will be injected (%s)", FAULTS_ENV, spec)
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

    def prepare(self, *args: Any, **kwargs: Any) -> PassInputs:
        return self.backend.prepare(*args, **kwargs)

    def run(self, inputs: PassInputs, *, eager: bool = False) -> torch.Tensor:
        self.faults.check(inputs.ids)
        self.faults.occupy_device()
        return self.backend.run(inputs, eager=eager)

    def computed_tokens(self, inputs: PassInputs) -> int:
        return self.backend.computed_tokens(inputs)

    def describe(self) -> dict[str, Any]:
        return self.backend.describe()

    @property
    def thread_counts(self) -> tuple[int, ...] | None:
        return self.backend.thread_counts


def answers(engine, bodies, url_path=""):
    responses, report = engine.handle_with_report([RawRequest(json.dumps(b).encode(), None, url_path) for b in bodies])
    return [(r.status, json.loads(r.body)) for r in responses], report
