"""What a pass costs on this worker, measured at warm-up: the planner's price of one more pass,
a CUDA graph replay's, the worker's speed (which bounds a batch's work), and the smallest pass
worth borrowing idle CPUs for.

Passes are timed through the backend the worker serves with, on its own threads (none
borrowed), in its dtype. The time of a token comes from two passes that differ in size: on a
CPU a one-input pass and a CALIBRATION_TOKENS one; on a GPU, where both would only be launching
kernels, half and all of max_batch_tokens, which keep it computing. A one-input pass run
eagerly then gives the cost of a pass beyond its tokens; replayed, that of a replay.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from embedserve.handler.backends.base import Backend, PassCost
from embedserve.handler.model.inputs import ModelInput

log = logging.getLogger(__name__)

# The timing passes: one short input, and this many tokens ...
CALIBRATION_TOKENS = 512
# ... or on a GPU, half and all of max_batch_tokens, in inputs of this length.
GPU_CALIBRATION_LENGTH = 128
# A pass expected to take less than this on the worker's own threads does not borrow: handing
# work between threads then costs more than a second core saves (a tiny BERT's 1x12 pass took
# 81 us on one ONNX Runtime thread, 151 us on two). The speed measured here sets the bar.
LEND_MIN_S = 0.002


@dataclass(frozen=True)
class Speed:
    pass_overhead_tokens: int
    tokens_per_second: float  # full passes, this worker's own threads
    replay_overhead_tokens: int  # what a graph replay costs beyond its tokens; the eager price without graphs
    lend_min_tokens: int  # padded tokens a pass needs to borrow idle CPUs


def measure_speed(backend: Backend, cost: PassCost, *, pad_id: int, max_positions: int | None) -> Speed:
    """Time passes of `backend` (see the module's docstring); `cost` holds the prices so far, kept
    where a noisy neighbour swamps the measurement."""
    timer = _Timer(backend, pad_id)
    short_length = min(64, max_positions or 64) // 4
    short = timer.seconds(1, short_length, eager=True)
    if backend.device.type == "cuda":
        length = min(GPU_CALIBRATION_LENGTH, max_positions or GPU_CALIBRATION_LENGTH)
        rows = max(2, cost.max_batch_tokens // length)
        half, full = timer.seconds(rows // 2, length, eager=True), timer.seconds(rows, length, eager=True)
        per_token = (full - half) / ((rows - rows // 2) * length)
    else:
        length = min(64, max_positions or 64)
        rows = max(2, CALIBRATION_TOKENS // length)
        full = timer.seconds(rows, length)
        per_token = (full - short) / (rows * length - short_length)
    tokens_per_second = rows * length / full
    if per_token <= 0:  # a noisy neighbour swamped the measurement; keep what we had
        return Speed(cost.pass_overhead_tokens, tokens_per_second, cost.replay_overhead_tokens, 0)

    def tokens_beyond(seconds: float, tokens: int) -> int:
        """What a pass of `tokens` that took `seconds` cost beyond its tokens, in tokens."""
        return int(min(cost.max_batch_tokens, max(1, round(seconds / per_token - tokens))))

    overhead = tokens_beyond(short, short_length)
    replay = overhead
    if backend.describe().get("cuda_graphs"):
        replayed = timer.seconds(1, short_length)
        replay = tokens_beyond(replayed, backend.computed_tokens(timer.inputs(1, short_length)))
        log.info("a CUDA graph replay costs as much as %d tokens here", replay)
    return Speed(overhead, tokens_per_second, replay, max(0, round(LEND_MIN_S / per_token) - overhead))


class _Timer:
    def __init__(self, backend: Backend, pad_id: int):
        self.backend = backend
        self.pad_id = pad_id

    def inputs(self, rows: int, length: int):
        return self.backend.prepare([ModelInput([self.pad_id] * length)] * rows)

    def seconds(self, rows: int, length: int, *, eager: bool = False, repeats: int = 5) -> float:
        """The fastest of `repeats` runs of a (rows, length) pass, as passes run (replayed where a
        graph holds it) or `eager`: a busy neighbour only ever adds time."""
        inputs = self.inputs(rows, length)
        seconds = []
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first run warms this shape up and is not counted
                self._synchronize()
                started = time.perf_counter()
                self.backend.run(inputs, eager=eager)
                self._synchronize()
                seconds.append(time.perf_counter() - started)
        return min(seconds[1:])

    def _synchronize(self) -> None:
        """Wait for the GPU: kernels run asynchronously, a timer must see them finish."""
        if self.backend.device.type == "cuda":
            torch.cuda.synchronize(self.backend.device)
