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
        packed = pack([row.ids for row in rows], self.device)
        unpooled = np.fromiter((row.unpooled for row in rows), dtype=np.int64, count=len(rows))
        prompts = to_device(unpooled, self.device) if unpooled.any() else None
        ends = np.fromiter((row.pooled_end for row in rows), dtype=np.int64, count=len(rows))
        spans = to_device(ends, self.device) if ends.any() else None  # late chunking's: each span its own pass row
        return PackedInputs(packed.ids, packed.cu_seqlens, packed.max_len, prompts, spans)

    def run(self, inputs: PackedInputs, *, eager: bool = False) -> torch.Tensor:
        """-> (n, dimension) float32, in the order of the pass's rows."""
        return self.run_eager(inputs) if self.graphs is None or eager else self.graphs.run(inputs)

    def run_eager(self, inputs: PackedInputs) -> torch.Tensor:
        hidden = self.transformer(inputs.ids, inputs.cu_seqlens, inputs.max_len)  # (total, hidden)
        pooled = pool_packed(hidden, inputs.cu_seqlens, inputs.unpooled, self.modes,
                             inputs.pooled_end)  # (n, hidden * modes)
        return pooled if self.head is None else self.head(pooled)

    def computed_tokens(self, inputs: PackedInputs) -> int:
        """Real tokens only, but for the padding of the graph that replays the pass."""
        return inputs.ids.numel() if self.graphs is None else self.graphs.computed_tokens(inputs)

    @property
    def thread_counts(self) -> None:
        return None  # torch: any

    def describe(self) -> dict[str, Any]:
        return {"engine": "torch", "layout": "packed", "attention": self.transformer.attention_kernel,
                "cuda_graphs": 0 if self.graphs is None else len(self.graphs.graphs)}
