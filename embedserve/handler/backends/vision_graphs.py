"""CUDA graphs of a fixed-size vision tower (CLIP, SigLIP): one graph per batch size of the
ladder (`cuda_graph_batches`), each over a static buffer of pixel values at the processor's one
size, captured, sized and checked as a text encoder's are (backends/cuda_graphs.py:
`capture_checked`, every graph trusted or none).

A vision tower's images never see one another (attention runs within an image), so a pass of n
images replays the smallest graph of at least n, its spare rows left as the last pass left them:
they are computed and dropped. A pass larger than every graph runs eagerly. A SigLIP 2 NaFlex
tower is not captured: it resizes its position table to each image's grid on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from embedserve.handler.backends.cuda_graphs import Captured, StaticPass, capture_checked

# A tower's pass: (batch, channels, height, width) pixel values -> (batch, dimension) features.
Tower = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, order=True)
class ImageBucket:
    batch: int  # images a graph holds
    positions: int  # the patches each image costs the device

    @property
    def tokens(self) -> int:
        return self.batch * self.positions

    def __str__(self) -> str:
        return f"{self.batch} images"


class StaticImages(StaticPass):
    """One batch size's graph: a static pixel buffer, the tower's features in `output`."""

    def __init__(self, bucket: ImageBucket, tower: Tower, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device):
        super().__init__(bucket, device)
        self.pixels = torch.zeros((bucket.batch, *shape), dtype=dtype, device=device)
        self.tower = tower

    def compute(self) -> torch.Tensor:
        return self.tower(self.pixels)

    def run(self, pixels: torch.Tensor) -> torch.Tensor:
        """Copy the pass in, replay, return its rows' features (a view, valid until the next replay)."""
        rows = pixels.shape[0]
        self.pixels[:rows].copy_(pixels)
        self.replay()
        return self.output[:rows]


class ImageGraphs:
    """The captured batch sizes of one vision tower, and the choice between replay and eager."""

    def __init__(self, graphs: Captured, tower: Tower):
        self.graphs = graphs
        self.tower = tower  # the eager path, for a pass larger than every graph
        self.batches = sorted(graphs)

    @classmethod
    def capture(cls, tower: Tower, batches: Sequence[int], *, shape: Sequence[int], positions: int,
                dtype: torch.dtype, device: torch.device, max_bytes: int, tolerance: float,
                graph_type: type[StaticImages] = StaticImages) -> "ImageGraphs":
        """The graphs of `batches` whose pass needs at most max_bytes and whose capture works;
        none at all if a replay of random pixels strays from the eager pass by more than `tolerance`."""
        generator = torch.Generator().manual_seed(0)

        def random_pass(graph: StaticImages) -> tuple[torch.Tensor, torch.Tensor]:
            rows = max(1, graph.bucket.batch - 1)  # a spare row where the graph has one
            pixels = torch.randn((rows, *shape), generator=generator).to(device, dtype)
            return graph.run(pixels).clone(), tower(pixels)

        graphs = (graph_type(ImageBucket(batch, positions), tower, shape, dtype, device) for batch in batches)
        return cls(capture_checked(graphs, device, max_bytes, random_pass, tolerance), tower)

    def _holding(self, rows: int) -> ImageBucket | None:
        return next((bucket for bucket in self.batches if bucket.batch >= rows), None)

    def computed_tokens(self, rows: int, positions: int) -> int:
        """Positions the device computes for a pass of `rows` images: its graph's, else its own."""
        bucket = self._holding(rows)
        return bucket.tokens if bucket else rows * positions

    def run(self, pixels: torch.Tensor) -> torch.Tensor:
        bucket = self._holding(pixels.shape[0])
        return self.tower(pixels) if bucket is None else self.graphs[bucket].run(pixels)
