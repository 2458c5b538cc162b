"""CUDA graph capture and replay of the encoder's forward pass and pooling, per shape bucket.

A short forward pass on a GPU is dominated by kernel launches from Python; a captured graph
replays all of them at once. Graphs have fixed shapes, so one graph is captured per (batch,
sequence) bucket of a ladder, on static input and output buffers. A pass is padded up to the
smallest bucket that holds it: extra rows and columns are masked out, so the real rows equal the
eager result; a pass larger than every bucket runs eagerly. Capture stops at a memory cap, and
the buckets not captured run eagerly too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)

# Pooled output of one forward pass: (ids, mask) -> (batch, hidden).
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    length: int

    @property
    def tokens(self) -> int:
        return self.batch * self.length


def ladder(batches: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[Bucket]:
    """Every (batch, length) pair within the padded-token budget, largest first (capture order:
    the first graph sizes the shared memory pool, the later ones fit inside it)."""
    buckets = {Bucket(b, n) for b in batches for n in lengths if b * n <= max_tokens}
    return sorted(buckets, key=lambda bucket: (bucket.tokens, bucket), reverse=True)


def choose(buckets: Sequence[Bucket], batch: int, length: int) -> Bucket | None:
    """The bucket that holds (batch, length) with the fewest padded tokens, or None."""
    fitting = [b for b in buckets if b.batch >= batch and b.length >= length]
    return min(fitting, key=lambda b: (b.tokens, b.length), default=None)


class StaticGraph:
    """One bucket: static input buffers, and a replay that leaves the pooled output in `output`."""

    def __init__(self, bucket: Bucket, forward: Forward, pad_id: int, device: torch.device):
        self.bucket = bucket
        self.pad_id = pad_id
        self.ids = torch.full((bucket.batch, bucket.length), pad_id, dtype=torch.long, device=device)
        self.mask = torch.zeros_like(self.ids)
        self.mask[:, 0] = 1  # rows that carry no input still attend to one token: no NaNs
        self.forward = forward
        self.output: torch.Tensor | None = None

    def capture(self) -> None:
        # Warm-up on a side stream first, as CUDA graph capture requires, then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(self.ids, self.mask)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=GraphRunner.pool):
            self.output = self.forward(self.ids, self.mask)

    def replay(self) -> None:
        self.graph.replay()

    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Copy the pass into the static buffers, replay, and return the real rows."""
        rows, length = ids.shape
        self.ids.fill_(self.pad_id)
        self.mask.zero_()
        self.mask[:, 0] = 1
        self.ids[:rows, :length].copy_(ids)
        self.mask[:rows, :length].copy_(mask)
        self.replay()
        return self.output[:rows]


class GraphRunner:
    """The captured buckets of one encoder, and the choice between replay and eager."""

    pool = None  # one memory pool shared by every graph of the process

    def __init__(self, graphs: dict[Bucket, StaticGraph], forward: Forward):
        self.graphs = graphs
        self.forward = forward  # the eager path, for passes that fit no bucket
        self.buckets = sorted(graphs)
        self.replays = 0
        self.eager = 0

    @classmethod
    def capture(cls, forward: Forward, buckets: Sequence[Bucket], *, pad_id: int, device: torch.device,
                max_bytes: int, graph_type: type[StaticGraph] = StaticGraph,
                memory_in_use: Callable[[], int] | None = None) -> "GraphRunner":
        """Capture buckets in the given order until the memory they hold exceeds max_bytes."""
        if graph_type is StaticGraph and cls.pool is None:
            cls.pool = torch.cuda.graph_pool_handle()
        in_use = memory_in_use or (lambda: torch.cuda.memory_reserved(device))
        start = in_use()
        graphs: dict[Bucket, StaticGraph] = {}
        for bucket in buckets:
            graph = graph_type(bucket, forward, pad_id, device)
            graph.capture()
            graphs[bucket] = graph
            used = in_use() - start
            if used > max_bytes:
                log.warning("CUDA graphs: memory cap of %d MiB reached after %d of %d buckets; the rest run eagerly",
                            max_bytes >> 20, len(graphs), len(buckets))
                break
        log.info("CUDA graphs: captured %d buckets (%d MiB)", len(graphs), (in_use() - start) >> 20)
        return cls(graphs, forward)

    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Pooled output of the pass: a view of a static buffer, valid until the next replay."""
        bucket = choose(self.buckets, *ids.shape)
        if bucket is None:
            self.eager += 1
            return self.forward(ids, mask)
        self.replays += 1
        return self.graphs[bucket].run(ids, mask)
