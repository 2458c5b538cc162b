"""CUDA graphs for packed passes (handler/packed.py), one per size of pass in total tokens.

A packed pass has no batch or length dimension to bucket, only its total tokens, so the ladder
is one-dimensional: sizes every TOKEN_STEP tokens, then growing by 1 / RESOLUTION of themselves,
up to the largest pass the planner makes. A pass replays in the smallest size that holds it,
laid out in the graph's static buffers as:

    ids         (size,)          the pass's tokens, then padding ids
    cu_seqlens  (slots + 1,)     the pass's offsets; then the padding as inputs of its own (at
                                 most max_len tokens each), then zero-length inputs up to the
                                 slots (cu_seqlens repeats the size)
    unpooled    (slots,)         the pass's prompt counts, then zeros
    max_len                      fixed per graph: the longest input it takes

Every token belongs to some input, so position ids, attention and pooling run unchanged: the
padding inputs attend only to themselves and their pooled rows, like the zero-length ones', are
dropped. What the device computes is the size; the ladder's steps keep the padding under 1 /
RESOLUTION of it for passes of more than TOKEN_STEP * RESOLUTION tokens.

Capture, memory cap, per-size fallback to eager and the start-up check of replays against the
eager packed pass are handler/cuda_graphs.py's. Only the flash attention kernel of
torch.nn.attention.varlen reads its offsets on the device; the grouped SDPA reads them on the
host, which a capture refuses, so the encoder captures packed graphs only where attention is
varlen flash (handler/encoder.py).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from handler.cuda_graphs import StaticPass, capture_checked
from handler.packed import PackedInputs, pack
from handler.transfer import to_device

log = logging.getLogger(__name__)

# The eager packed pass: inputs -> (inputs, dimension) float32 (PackedPasses.run_eager).
PackedForward = Callable[[PackedInputs], torch.Tensor]

# The ladder: a size every TOKEN_STEP tokens up to TOKEN_STEP * RESOLUTION, then steps of
# 1 / RESOLUTION of the size rounded down to TOKEN_STEP: a pass pads by less than one step, so
# by under 1 / RESOLUTION of its size (0.8% on average) past 1024 tokens. Up to 16384: 278 sizes.
TOKEN_STEP = 16
RESOLUTION = 64


@dataclass(frozen=True, order=True)
class TokenBucket:
    tokens: int

    def __str__(self) -> str:
        return f"{self.tokens} tokens"


def token_ladder(max_tokens: int, step: int = TOKEN_STEP, resolution: int = RESOLUTION) -> list[int]:
    """Pass sizes in total tokens, smallest first, the last `max_tokens`."""
    sizes = []
    size = step
    while size < max_tokens:
        sizes.append(size)
        size += max(step, size // resolution // step * step)
    return sizes + [max_tokens]


class PackedGraph(StaticPass):
    """One size of packed pass: static ids, offsets and prompt counts, the pooled output of
    every slot. Takes at most `inputs` inputs of at most `max_len` tokens, and up to `spare`
    padding tokens (the ladder's step below this size)."""

    def __init__(self, tokens: int, forward: PackedForward, *, inputs: int, max_len: int, spare: int, pad_id: int,
                 device: torch.device):
        super().__init__(TokenBucket(tokens), device)
        self.tokens = tokens
        self.forward = forward
        self.inputs = inputs
        self.max_len = max_len
        self.spare = spare
        self.slots = inputs + math.ceil(spare / max_len)  # the pass's inputs, then padding inputs
        self.pad_id = pad_id
        self.ids = torch.full((tokens,), pad_id, dtype=torch.long, device=device)
        # Until a pass is loaded: the size cut into max_len inputs, the most attention this graph
        # computes (warm-up measures its memory, capture records it).
        self.cu_seqlens = to_device(np.concatenate([np.zeros(1, dtype=np.int32), self._tail(0, 0)]), device)
        self.unpooled = torch.zeros(self.slots, dtype=torch.long, device=device)

    def compute(self) -> torch.Tensor:
        return self.forward(PackedInputs(self.ids, self.cu_seqlens, self.max_len, self.unpooled))

    def holds(self, inputs: PackedInputs) -> bool:
        count, total = inputs.cu_seqlens.numel() - 1, inputs.ids.numel()
        padding_inputs = math.ceil((self.tokens - total) / self.max_len)
        return total <= self.tokens and count <= self.inputs and inputs.max_len <= self.max_len and \
            count + padding_inputs <= self.slots

    def run(self, inputs: PackedInputs) -> torch.Tensor:
        """Copy the pass into the static buffers, replay, and return its rows of the output."""
        count, total = inputs.cu_seqlens.numel() - 1, inputs.ids.numel()
        self.ids[:total].copy_(inputs.ids)
        self.ids[total:].fill_(self.pad_id)
        self.cu_seqlens[:count + 1].copy_(inputs.cu_seqlens)
        # The rest of the offsets depend only on sizes the host knows: no wait for the device.
        self.cu_seqlens[count + 1:].copy_(to_device(self._tail(total, count), self.device))
        self.unpooled.zero_()
        if inputs.unpooled is not None:
            self.unpooled[:count].copy_(inputs.unpooled)
        self.replay()
        return self.output[:count]

    def _tail(self, total: int, count: int) -> np.ndarray:
        """(slots - count,) int32: the ends of the padding inputs, max_len tokens each but the
        last, then of the zero-length inputs (the size, repeated)."""
        ends = total + self.max_len * np.arange(1, self.slots - count + 1, dtype=np.int64)
        return np.minimum(ends, self.tokens).astype(np.int32)


class PackedGraphRunner:
    """The captured sizes of one encoder's packed passes, and the choice between replay and eager."""

    def __init__(self, graphs: dict[TokenBucket, PackedGraph], forward: PackedForward):
        self.graphs = graphs
        self.forward = forward  # the eager path, for passes no graph holds
        self.ladder = [graphs[bucket] for bucket in sorted(graphs)]
        self.sizes = [graph.tokens for graph in self.ladder]
        self.replays = 0
        self.eager = 0

    @classmethod
    def capture(cls, forward: PackedForward, sizes: Sequence[int], *, max_inputs: int, max_len: int, pad_id: int,
                vocab_size: int, device: torch.device, max_bytes: int, tolerance: float,
                graph_type: type[PackedGraph] = PackedGraph) -> "PackedGraphRunner":
        """Graphs for the ladder `sizes` (smallest first) whose pass needs at most max_bytes and
        whose capture works, on `device`; none at all if a replay strays from eager by more than
        `tolerance`. Passes hold at most `max_inputs` inputs of at most `max_len` tokens."""
        generator = np.random.default_rng(0)

        def random_pass(graph: PackedGraph) -> tuple[torch.Tensor, torch.Tensor]:
            """A pass of mixed lengths leaving the graph padding and unused slots: replayed, eager."""
            inputs = _random_pass(graph, vocab_size, generator)
            return graph.run(inputs).clone(), forward(inputs)

        below = [0, *sizes[:-1]]
        graphs = (graph_type(size, forward, inputs=min(max_inputs, size), max_len=min(max_len, size),
                             spare=size - smaller, pad_id=pad_id, device=device)
                  for size, smaller in zip(sizes, below))
        return cls(capture_checked(graphs, device, max_bytes, random_pass, tolerance), forward)

    def choose(self, inputs: PackedInputs) -> PackedGraph | None:
        """The smallest graph that holds the pass, or None. Bisected: the ladder has hundreds of
        sizes, and the first one with room for the pass's tokens nearly always holds it."""
        first = bisect_left(self.sizes, inputs.ids.numel())
        return next((graph for graph in self.ladder[first:] if graph.holds(inputs)), None)

    def run(self, inputs: PackedInputs) -> torch.Tensor:
        """(inputs, dimension) float32; where replayed, a view of a static buffer valid until the next replay."""
        graph = self.choose(inputs)
        if graph is None:
            self.eager += 1
            return self.forward(inputs)
        self.replays += 1
        return graph.run(inputs)

    def computed_tokens(self, inputs: PackedInputs) -> int:
        """Tokens the device computes for the pass: its graph's size where one holds it."""
        graph = self.choose(inputs)
        return inputs.ids.numel() if graph is None else graph.tokens


def _random_pass(graph: PackedGraph, vocab_size: int, generator: np.random.Generator) -> PackedInputs:
    """Random ids in random lengths, the first as long as the graph takes, leaving between one
    and `spare` tokens of padding, within the graph's inputs; a few leading tokens of each left
    out of pooling."""
    padding = int(generator.integers(1, min(graph.spare, graph.tokens - 1) + 1)) if graph.tokens > 1 else 0
    remaining = graph.tokens - padding
    lengths: list[int] = []
    while remaining:
        room = graph.inputs - len(lengths)  # inputs left, each at most max_len long
        shortest = max(1, remaining - (room - 1) * graph.max_len)
        longest = min(graph.max_len, remaining)
        length = longest if not lengths else int(generator.integers(shortest, longest + 1))
        lengths.append(length)
        remaining -= length
    rows = [generator.integers(0, vocab_size, size=length).tolist() for length in lengths]
    packed = pack(rows, graph.device)
    # At least one token of each pooled: with none, max pooling gives -inf, which no comparison takes.
    unpooled = np.minimum(generator.integers(0, 3, size=len(rows)), np.asarray(lengths) - 1).astype(np.int64)
    unpooled = to_device(unpooled, graph.device)
    return PackedInputs(packed.ids, packed.cu_seqlens, packed.max_len, unpooled)
