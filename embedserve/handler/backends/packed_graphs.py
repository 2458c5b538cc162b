"""CUDA graphs for packed passes (embedserve/handler/backends/packed.py), one per (total tokens, inputs) of a pass.

A packed pass has no batch or length dimension to bucket, only its total tokens and its count
of inputs. Varlen flash attention launches ceil(max_len / block) blocks per input slot and head,
empty slots included, so a graph's slots cost as much as its tokens do: a pass of 32 short
inputs replayed in a graph of 257 slots launches eight times the attention blocks of one of 33
slots. So the ladder has two dimensions:

- sizes in total tokens: every TOKEN_STEP tokens, then growing by 1 / RESOLUTION of themselves,
  up to the largest pass the planner makes (`token_ladder`);
- per size, input tiers doubling from FIRST_TIER up to the most inputs a pass may hold
  (`slot_tiers`). A size of T tokens takes no tier beyond the first that holds min(T, most
  inputs) (a pass of T tokens holds at most T inputs), nor a tier too small to carry more
  tokens than the size below it (its inputs are at most max_len long), as such passes take a
  smaller size (`packed_ladder`).

A pass replays in the cheapest graph that holds it, fewest tokens first, then fewest inputs,
laid out in the graph's static buffers as:

    ids         (size,)          the pass's tokens, then padding ids
    cu_seqlens  (slots + 1,)     the pass's offsets; then the padding as inputs of its own (at
                                 most max_len tokens each), then zero-length inputs up to the
                                 slots (cu_seqlens repeats the size)
    unpooled    (slots,)         the pass's prompt counts, then zeros
    max_len                      fixed per graph: the longest input it takes

where slots = the tier's inputs + the padding inputs the size's spare tokens need. Every token
belongs to some input, so position ids, attention and pooling run unchanged: the padding inputs
attend only to themselves and their pooled rows, like the zero-length ones', are dropped. What
the device computes is the size; the ladder's steps keep the padding under 1 / RESOLUTION of it
for passes of more than TOKEN_STEP * RESOLUTION tokens.

max_len is the engine's max_length, the longest input it ever passes (truncated, special tokens
included), not the position table's size: it sets the attention blocks per slot. A longer input
cannot reach the encoder; were one to, no graph would hold its pass and it would run eagerly.

Count and cost, for all-MiniLM-L6-v2 on a GPU (max_batch_tokens 16384, max_batch_size 256,
max_length 256): 278 sizes and tiers 32, 64, 128, 256 make 1,051 graphs, not 4 x 278, as small
sizes take fewer tiers and tier 32 stops past 8192 tokens (32 inputs of 256). Start-up warms,
captures and checks each graph: seven passes (two warm-up, the capture, two replays and the
two eager passes they are checked against), about 100 kernels each, so a millisecond or two of
launches from Python per eager pass, plus compute: the graphs total 4.0 million tokens, 3.5x
the 278 sizes' 1.2 million. An estimated 10-25 ms a graph, 10-25 s of start-up in all, about
four times one graph per size (not yet measured on a GPU). Beyond the shared pool, the graphs'
static inputs and outputs (one float32 vector per slot) hold about 32 MiB and 190 MiB, against
10 MiB and 102 MiB for one graph of 257 slots or more per size.

Capture, memory cap, the fallback to eager and the start-up check of replays against the
eager packed pass are embedserve/handler/backends/cuda_graphs.py's. Only the flash attention kernel of
torch.nn.attention.varlen reads its offsets on the device; the grouped SDPA reads them on the
host, which a capture refuses, so the selection captures packed graphs only where attention
is varlen flash (embedserve/handler/execution/select.py).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from embedserve.handler.backends.cuda_graphs import StaticPass, capture_checked
from embedserve.handler.model.packed_forward import PackedInputs, pack
from embedserve.handler.worker.transfer import to_device

log = logging.getLogger(__name__)

# The eager packed pass: inputs -> (inputs, dimension) float32 (PackedBackend.run_eager).
PackedForward = Callable[[PackedInputs], torch.Tensor]

# The ladder: a size every TOKEN_STEP tokens up to TOKEN_STEP * RESOLUTION, then steps of
# 1 / RESOLUTION of the size rounded down to TOKEN_STEP: a pass pads by less than one step, so
# by under 1 / RESOLUTION of its size (0.8% on average) past 1024 tokens. Up to 16384: 278 sizes.
TOKEN_STEP = 16
RESOLUTION = 64
# The fewest inputs a tier holds; tiers double from here, so a pass of over FIRST_TIER inputs
# replays in fewer than twice its inputs' slots (plus its padding's).
FIRST_TIER = 32


@dataclass(frozen=True, order=True)
class TokenBucket:
    tokens: int
    inputs: int

    def __str__(self) -> str:
        return f"{self.tokens} tokens x {self.inputs} inputs"


def token_ladder(max_tokens: int, step: int = TOKEN_STEP, resolution: int = RESOLUTION) -> list[int]:
    """Pass sizes in total tokens, smallest first, the last `max_tokens`."""
    sizes = []
    size = step
    while size < max_tokens:
        sizes.append(size)
        size += max(step, size // resolution // step * step)
    return sizes + [max_tokens]


def slot_tiers(max_inputs: int, first: int = FIRST_TIER) -> list[int]:
    """Input counts graphs are captured for: doubling from `first`, the last `max_inputs`."""
    tiers = []
    tier = first
    while tier < max_inputs:
        tiers.append(tier)
        tier *= 2
    return tiers + [max_inputs]


@dataclass(frozen=True)
class GraphShape:
    tokens: int
    inputs: int  # at most this many inputs of the pass ...
    max_len: int  # ... each at most this long
    spare: int  # the padding a pass may leave: the tokens between the size below and this one


def packed_ladder(sizes: Sequence[int], max_inputs: int, max_len: int) -> list[GraphShape]:
    """The graphs worth capturing for the ladder `sizes` (smallest first, none over
    max_inputs * max_len), by tokens then inputs. A pass of more tokens than the size below
    lands in a size; with few enough inputs, in one of its tiers: those below the size's most
    inputs, min(size, max_inputs), then the first that holds them, leaving out any tier too small
    to carry more tokens than the size below."""
    shapes = []
    for size, smaller in zip(sizes, [0, *sizes[:-1]]):
        most, length = min(max_inputs, size), min(max_len, size)
        for tier in slot_tiers(max_inputs):
            inputs = min(tier, most)
            if inputs * length > smaller:
                shapes.append(GraphShape(size, inputs, length, size - smaller))
            if inputs == most:
                break
    return shapes


class PackedGraph(StaticPass):
    """One shape of packed pass: static ids, offsets and prompt counts, the pooled output of
    every slot. Takes at most `inputs` inputs of at most `max_len` tokens, and up to `spare`
    padding tokens (the ladder's step below this size)."""

    def __init__(self, tokens: int, forward: PackedForward, *, inputs: int, max_len: int, spare: int, pad_id: int,
                 device: torch.device):
        if inputs * max_len <= tokens - spare:  # the warm-up layout below would leave tokens in no input
            raise ValueError(f"{inputs} inputs of {max_len} tokens hold no pass of over {tokens - spare} tokens")
        super().__init__(TokenBucket(tokens, inputs), device)
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
    """The captured graphs of one encoder's packed passes, and the choice between replay and eager."""

    def __init__(self, graphs: dict[TokenBucket, PackedGraph], forward: PackedForward):
        self.graphs = graphs
        self.forward = forward  # the eager path, for passes no graph holds
        self.ladder = [graphs[bucket] for bucket in sorted(graphs)]  # cheapest first: tokens, then inputs
        self.keys = [(graph.tokens, graph.inputs) for graph in self.ladder]
        # What no graph takes, so such a pass skips the search.
        self.max_inputs = max((graph.inputs for graph in self.ladder), default=0)
        self.max_len = max((graph.max_len for graph in self.ladder), default=0)
        self.replays = 0
        self.eager = 0

    @classmethod
    def capture(cls, forward: PackedForward, sizes: Sequence[int], *, max_inputs: int, max_len: int, pad_id: int,
                vocab_size: int, device: torch.device, max_bytes: int, tolerance: float,
                graph_type: type[PackedGraph] = PackedGraph) -> "PackedGraphRunner":
        """Graphs for the ladder `sizes` (smallest first, none over max_inputs * max_len), in the
        tiers of `packed_ladder`, whose pass needs at most max_bytes and whose capture works, on
        `device`; none at all if a replay strays from eager by more than `tolerance`. Passes hold
        at most `max_inputs` inputs of at most `max_len` tokens."""
        generator = np.random.default_rng(0)

        def random_pass(graph: PackedGraph) -> tuple[torch.Tensor, torch.Tensor]:
            """A pass of mixed lengths leaving the graph padding and unused slots: replayed, eager."""
            inputs = _random_pass(graph, vocab_size, generator)
            return graph.run(inputs).clone(), forward(inputs)

        graphs = (graph_type(shape.tokens, forward, inputs=shape.inputs, max_len=shape.max_len, spare=shape.spare,
                             pad_id=pad_id, device=device)
                  for shape in packed_ladder(sizes, max_inputs, max_len))
        return cls(capture_checked(graphs, device, max_bytes, random_pass, tolerance), forward)

    def choose(self, inputs: PackedInputs) -> PackedGraph | None:
        """The cheapest graph that holds the pass (fewest tokens, then fewest inputs), or None.
        Bisected on (tokens, inputs): the ladder has about a thousand graphs, and the first with
        room for both nearly always holds the pass (a later one only when a graph is missing)."""
        count = inputs.cu_seqlens.numel() - 1
        if count > self.max_inputs or inputs.max_len > self.max_len:
            return None
        first = bisect_left(self.keys, (inputs.ids.numel(), count))
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
    and `spare` tokens of padding (at least what the graph's inputs cannot carry), within the
    graph's inputs; a few leading tokens of each left out of pooling."""
    fewest = max(1, graph.tokens - graph.inputs * graph.max_len)
    padding = int(generator.integers(fewest, min(graph.spare, graph.tokens - 1) + 1)) if graph.tokens > 1 else 0
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
