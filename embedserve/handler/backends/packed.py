"""Packed passes behind the execution seam (embedserve/handler/backends/base.py): the real tokens
of a pass concatenated, no padding computed (embedserve/handler/model/packed_forward.py), planned
by real tokens, pooled, then through the pipeline's head; CUDA graphs over total tokens and input
tiers (embedserve/handler/backends/packed_graphs.py) replay the passes they hold.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from embedserve.handler.backends.base import PassCost
from embedserve.handler.backends.packed_graphs import PackedGraphRunner
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.packed_forward import PackedInputs, PackedTransformer, pack, pool_packed
from embedserve.handler.scheduling.planner import plan_packed
from embedserve.handler.worker.transfer import to_device


class PackedBackend:
    """Passes packed: planned by real tokens, run through a PackedTransformer, pooled, then
    through the pipeline's head (backends/base.py's seam). `graphs` (backends/packed_graphs.py's
    PackedGraphRunner, captured on this backend's `run_eager`) replay the passes they hold; the
    rest run eagerly."""

    def __init__(self, transformer: PackedTransformer, modes: Sequence[str], head: torch.nn.Module | None,
                 graphs: PackedGraphRunner | None = None):
        self.transformer = transformer
        self.modes = tuple(modes)
        self.head = head
        self.graphs = graphs
        self.device = transformer.device

    def with_graphs(self, graphs: PackedGraphRunner | None) -> "PackedBackend":
        """The same backend, replaying `graphs`."""
        return PackedBackend(self.transformer, self.modes, self.head, graphs)

    def plan(self, lengths: Sequence[int], cost: PassCost) -> list[list[int]]:
        return plan_packed(lengths, cost.max_batch_tokens, cost.max_batch_size)

    def prepare(self, rows: Sequence[ModelInput]) -> PackedInputs:
        if any(row.second for row in rows):  # select.py never packs a scoring model
            raise ValueError("packed passes carry no token types")
        if any(row.pooled_end for row in rows):
            return self._spans(rows)
        packed = pack([row.ids for row in rows], self.device)
        unpooled = np.fromiter((row.unpooled for row in rows), dtype=np.int64, count=len(rows))
        prompts = to_device(unpooled, self.device) if unpooled.any() else None
        return PackedInputs(packed.ids, packed.cu_seqlens, packed.max_len, prompts)

    def _spans(self, rows: Sequence[ModelInput]) -> PackedInputs:
        """Late chunking's spans (model/inputs.py): each distinct row packed once, and where each
        row's pooled tokens sit in the pass (from `unpooled` to `pooled_end`, or its end)."""
        distinct: dict[tuple[int, ...], int] = {}
        owners = [distinct.setdefault(tuple(row.ids), len(distinct)) for row in rows]  # each row's packed row
        packed = pack(list(distinct), self.device)
        starts = np.cumsum([0, *map(len, distinct)])[owners]  # where each row's packed row begins
        first = starts + np.fromiter((min(row.unpooled, len(row)) for row in rows), dtype=np.int64, count=len(rows))
        last = starts + np.fromiter((row.pooled_end or len(row) for row in rows), dtype=np.int64, count=len(rows))
        positions = np.concatenate([np.arange(a, b) for a, b in zip(first, last)])
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(last - first, out=offsets[1:])
        return PackedInputs(packed.ids, packed.cu_seqlens, packed.max_len, None,
                            (to_device(positions, self.device), to_device(offsets, self.device)))

    def run(self, inputs: PackedInputs, *, eager: bool = False) -> torch.Tensor:
        """-> (n, dimension) float32, in the order of the pass's rows."""
        # A graph was captured for a row pooled per input: spans run eagerly.
        return self.run_eager(inputs) if self.graphs is None or eager or inputs.spans is not None \
            else self.graphs.run(inputs)

    def run_eager(self, inputs: PackedInputs) -> torch.Tensor:
        hidden = self.transformer(inputs.ids, inputs.cu_seqlens, inputs.max_len)  # (total, hidden)
        if inputs.spans is not None:  # each span's tokens gathered, pooled as an input of its own
            positions, offsets = inputs.spans
            pooled = pool_packed(hidden[positions], offsets, None, self.modes)
        else:
            pooled = pool_packed(hidden, inputs.cu_seqlens, inputs.unpooled, self.modes)  # (n, hidden * modes)
        return pooled if self.head is None else self.head(pooled)

    def computed_tokens(self, inputs: PackedInputs) -> int:
        """Real tokens only, but for the padding of the graph that replays the pass."""
        if self.graphs is None or inputs.spans is not None:
            return inputs.ids.numel()
        return self.graphs.computed_tokens(inputs)

    @property
    def thread_counts(self) -> None:
        return None  # torch: any

    def describe(self) -> dict[str, Any]:
        return {"engine": "torch", "layout": "packed", "attention": self.transformer.attention_kernel,
                "cuda_graphs": 0 if self.graphs is None else len(self.graphs.graphs)}
