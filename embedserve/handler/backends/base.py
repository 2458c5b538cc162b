"""The execution seam: one small interface for every way of running the transformer on a pass.

A backend owns its pass layout. It cuts a batch's inputs into passes (`plan`), lays one pass out
as its device takes it (`prepare`), runs it to pooled vectors with the pipeline's head applied
(`run`), and says what the device computed, padding included (`computed_tokens`). `describe` is
what /info shows of it.

    padded.PaddedBackend   right-padded (batch, seq) passes: a torch model or an ONNX Runtime
                           session; CUDA graphs replayed by (batch, length) bucket, or none
    packed.PackedBackend   the real tokens of a pass concatenated (torch); CUDA graphs over
                           total tokens and input tiers, or none

Each is built from its parts (a transformer, pooling modes, a head, graphs already captured),
never from the encoder. embedserve/handler/execution/select.py is the one place that builds them, captures graphs
and picks one for the worker; embedserve/handler/execution/encoder.py runs passes on that one and keeps what every
backend shares: the out-of-memory split, CPU lending, the classification of device failures.
A new way of running the model (another runtime, a CPU's matrix units) is one more backend
and one more choice in select.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from embedserve.handler.model.inputs import ModelInput


@dataclass(frozen=True)
class PassCost:
    """What the planner weighs when it cuts passes: their size limits, and what one more pass
    costs beyond its tokens, eagerly and as a CUDA graph replay (measured at warm-up,
    embedserve/handler/execution/calibration.py)."""
    max_batch_tokens: int
    max_batch_size: int
    pass_overhead_tokens: int
    replay_overhead_tokens: int


class PassInputs(Protocol):
    """One prepared pass; every layout keeps its token ids, on the backend's device, as `ids`."""
    ids: torch.Tensor


class Backend(Protocol):
    device: torch.device

    def plan(self, lengths: Sequence[int], cost: PassCost) -> list[list[int]]:
        """Item indices per pass, at the least cost."""

    def prepare(self, rows: Sequence[ModelInput]) -> PassInputs:
        """One pass laid out on the device, a row per input (model/inputs.py)."""

    def run(self, inputs: PassInputs, *, eager: bool = False) -> torch.Tensor:
        """(rows, dimension) float32, in row order; `eager` skips any graph. A replayed graph's
        output is a view of its static buffer, valid until its next replay."""

    def computed_tokens(self, inputs: PassInputs) -> int:
        """Tokens the device computes for the pass: its padding and its graph's included."""

    def describe(self) -> dict[str, Any]:
        """engine, layout, attention kernel, graphs replayed: for /info and the logs."""

    @property
    def thread_counts(self) -> tuple[int, ...] | None:
        """The CPU thread counts a pass can run on: a runtime that fixes its threads when it is
        built (ONNX Runtime, OpenVINO) runs only those; None: any (torch)."""

