"""Padded passes: a pass's inputs right-padded into one (batch, seq) rectangle, run by a torch
model or an ONNX Runtime session, pooled, then through the pipeline's head. A scoring model
(no pooling modes) gives its logits per row directly, with a pair's token types where it takes them.

Every engine runs this layout. The planner (scheduling/planner.py) cuts passes at the least
padding plus pass cost; with CUDA graphs (backends/cuda_graphs.py, captured by
execution/select.py and handed in) a pass replays in the smallest (batch, length) bucket that
holds it, and the planner prices it at that bucket's tokens.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from embedserve.handler.backends.base import PassCost
from embedserve.handler.backends.cuda_graphs import GraphRunner
from embedserve.handler.model.inputs import ModelInput, TokenRole
from embedserve.handler.model.pooling import pool
from embedserve.handler.scheduling.planner import Replay, padded_length, plan_sub_batches
from embedserve.handler.worker.transfer import to_device

# (batch, seq) ids, attention mask and token types (None: all 0) -> (batch, seq, hidden) states, or
# (batch, labels) logits: a torch model (model/loading.py's TorchTransformer), an ONNX Runtime
# session (backends/onnx_runtime.py) or an OpenVINO model (backends/openvino_runtime.py).
Transformer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# (batch, seq, hidden) states, the TokenRole mask and the ids -> the pass's rows: (batch, dimension)
# float32 (SPLADE), or several outputs a row (bge-m3, model/m3.py).
TokenPooling = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]


class PaddedInputs(NamedTuple):
    ids: torch.Tensor  # (rows, length) int64, padding ids after each row's tokens
    mask: torch.Tensor  # (rows, length): each position's TokenRole
    # Rows of the same ids that pool different spans (late chunking) share one forward: the rows
    # the transformer runs (distinct,) and, for each row, which of them it pools; None: every row.
    shared: tuple[torch.Tensor, torch.Tensor] | None = None


class PaddedBackend:
    """Passes as right-padded rectangles. `facts` says what runs them, for /info: the engine
    and the attention kernel. No `modes`: the transformer scores (one row of logits per input);
    `segments`: it takes token type ids, a pair's second text being type 1. `token_pooling`: pools
    the token states its own way instead of the modes and head (SPLADE, model/sparse.py; bge-m3,
    model/m3.py)."""

    def __init__(self, transformer: Transformer, *, modes: Sequence[str], head: torch.nn.Module | None, pad_id: int,
                 pad_multiple: int, device: torch.device, facts: dict[str, Any], graphs: GraphRunner | None = None,
                 segments: bool = False, token_pooling: TokenPooling | None = None):
        self.transformer = transformer
        self.modes = tuple(modes)
        self.head = head
        self.pad_id = pad_id
        self.pad_multiple = pad_multiple  # GPU passes pad to tensor-core tiles; CPU passes to their longest row
        self.device = device
        self.facts = dict(facts)
        self.graphs = graphs
        self.segments = segments
        self.token_pooling = token_pooling

    def with_graphs(self, graphs: GraphRunner | None) -> "PaddedBackend":
        """The same backend, replaying `graphs` (captured on this one's `pooled`)."""
        return PaddedBackend(self.transformer, modes=self.modes, head=self.head, pad_id=self.pad_id,
                             pad_multiple=self.pad_multiple, device=self.device, facts=self.facts, graphs=graphs,
                             segments=self.segments, token_pooling=self.token_pooling)

    def with_transformer(self, transformer: Transformer) -> "PaddedBackend":
        """The same layout, pooling and head around another transformer (a trial quantization),
        run eagerly: graphs recorded the old one."""
        return PaddedBackend(transformer, modes=self.modes, head=self.head, pad_id=self.pad_id,
                             pad_multiple=self.pad_multiple, device=self.device, facts=self.facts,
                             segments=self.segments, token_pooling=self.token_pooling)

    def plan(self, lengths: Sequence[int], cost: PassCost) -> list[list[int]]:
        replay = None if self.graphs is None else Replay(self.graphs.table, cost.replay_overhead_tokens)
        return plan_sub_batches(lengths, cost.max_batch_tokens, cost.max_batch_size, self.pad_multiple,
                                cost.pass_overhead_tokens, replay)

    def prepare(self, rows: Sequence[ModelInput]) -> PaddedInputs:
        """Right-pad to the longest row, rounded up to the pad multiple; the mask holds each
        position's TokenRole: padding, pooled, a prompt pooling leaves out, a pair's second text."""
        sizes = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        length = padded_length(int(sizes.max()), self.pad_multiple)
        positions = np.arange(length)
        real = positions < sizes[:, None]  # (rows, length): True on each row's own tokens
        ids = np.full((len(rows), length), self.pad_id, dtype=np.int64)
        ids[real] = np.fromiter(chain.from_iterable(row.ids for row in rows), dtype=np.int64,
                                count=int(sizes.sum()))  # row by row
        mask = real.astype(np.int64)  # TokenRole.POOLED where real, PAD elsewhere
        # Most passes have no prompt left out, no pair, no expansion and no span: a look at the
        # rows costs less than the arrays that would say so.
        if any(row.unpooled for row in rows):
            unpooled = np.fromiter((row.unpooled for row in rows), dtype=np.int64, count=len(rows))
            mask[positions < np.minimum(unpooled, sizes)[:, None]] = TokenRole.PROMPT
        if any(row.second for row in rows):
            starts = np.fromiter((row.second for row in rows), dtype=np.int64, count=len(rows))
            mask[real & (starts[:, None] > 0) & (positions >= starts[:, None])] = TokenRole.SECOND
        if any(row.expansion for row in rows):
            expansion = np.fromiter((row.expansion for row in rows), dtype=np.int64, count=len(rows))
            mask[real & (positions >= (sizes - expansion)[:, None])] = TokenRole.EXPANSION
        shared = None
        if any(row.pooled_end for row in rows):  # spans of late chunking: attended to, pooled only within the span
            ends = np.fromiter((row.pooled_end for row in rows), dtype=np.int64, count=len(rows))
            mask[real & (ends[:, None] > 0) & (positions >= ends[:, None])] = TokenRole.PROMPT
            shared = self._shared(ids, real)
        return PaddedInputs(to_device(ids, self.device), to_device(mask, self.device), shared)

    def _shared(self, ids: np.ndarray, real: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The distinct rows of a pass and which one each row is, where some repeat: the same ids
        over the same length (a row whose last token is the padding id is not a shorter one)."""
        rows = np.concatenate([ids, real.astype(np.int64)], axis=1)
        _, first, source = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        if len(first) == len(ids):
            return None
        return to_device(first.astype(np.int64), self.device), to_device(source.reshape(-1).astype(np.int64),
                                                                         self.device)

    def run(self, inputs: PaddedInputs, *, eager: bool = False) -> torch.Tensor:
        # A graph was captured for a pass of distinct rows: one with shared rows runs eagerly.
        if self.graphs is None or eager or inputs.shared is not None:
            return self.pooled(inputs.ids, inputs.mask, inputs.shared)
        return self.graphs.run(inputs.ids, inputs.mask)

    def pooled(self, ids: torch.Tensor, mask: torch.Tensor,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The eager pass: (batch, seq) ids and pooling mask -> (batch, dimension) float32."""
        # Prompt tokens left out of pooling are still attended to; expansion tokens and padding are not.
        attention = mask.clamp(min=0, max=1)
        segments = (mask == TokenRole.SECOND).to(ids.dtype) if self.segments else None
        if shared is not None:  # the distinct rows through the model, each row's states gathered back
            distinct, source = shared
            hidden = self.transformer(ids[distinct], attention[distinct],
                                      None if segments is None else segments[distinct])[source]
        else:
            hidden = self.transformer(ids, attention, segments)  # (batch, seq, hidden), or (batch, labels) logits
        if self.token_pooling is not None:
            return self.token_pooling(hidden, mask, ids)
        if not self.modes:
            return hidden.to(torch.float32)
        pooled = pool(hidden, mask, self.modes)  # (batch, hidden * modes)
        return pooled if self.head is None else self.head(pooled)

    def computed_tokens(self, inputs: PaddedInputs) -> int:
        """All of its bucket's tokens where a graph replays the pass; its distinct rows' where rows repeat."""
        if inputs.shared is not None:
            return len(inputs.shared[0]) * inputs.ids.shape[1]
        return inputs.ids.numel() if self.graphs is None else self.graphs.computed_tokens(*inputs.ids.shape)

    @property
    def thread_counts(self) -> tuple[int, ...] | None:
        return getattr(self.transformer, "thread_counts", None)

    def describe(self) -> dict[str, Any]:
        return {**self.facts, "layout": "padded", "cuda_graphs": 0 if self.graphs is None else len(self.graphs.graphs)}
