"""Images through an image-text model's vision tower: torch's (model/towers.py), or its ONNX
export on a CPU, in float32 on ONNX Runtime (backends/onnx_runtime.py) or in bfloat16 on OpenVINO
(backends/openvino_runtime.py).

Every image is prepared to the same size (inputs/image.py), so a pass is a stack of pixel values
and costs the same positions an image: the planner cuts passes by count and the token budget
alone, never by padding. A SigLIP 2 NaFlex image keeps its aspect ratio, and its processor pads
its patches to one count: a pass stacks those, with each image's grid (model/towers.py). On a GPU
a fixed-size tower replays CUDA graphs of its passes where they were captured
(backends/vision_graphs.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from embedserve.handler.backends.base import PassCost
from embedserve.handler.backends.onnx_runtime import OnnxImageTower
from embedserve.handler.backends.openvino_runtime import OpenVinoImageTower
from embedserve.handler.backends.vision_graphs import ImageGraphs
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.towers import ImageTower
from embedserve.handler.scheduling.planner import plan_sub_batches


class ImageInputs(NamedTuple):
    pixels: torch.Tensor  # (rows, channels, height, width), NaFlex's (rows, patches, values); the backend's device and dtype
    positions: int  # the patches each image costs
    grids: torch.Tensor | None = None  # NaFlex: (rows, 2) each image's grid of real patches


class VisionBackend:
    def __init__(self, tower: ImageTower | OnnxImageTower | OpenVinoImageTower, *, dtype: torch.dtype,
                 device: torch.device, own_grid: bool = False, graphs: ImageGraphs | None = None):
        """`own_grid`: images keep their aspect ratio (SigLIP 2 NaFlex), their patches padded to one
        count; `graphs`: CUDA graphs of the tower's passes (a fixed-size tower on a GPU)."""
        self.tower = tower
        self.own_grid = own_grid
        self.graphs = graphs
        self.dtype = dtype
        self.device = device

    def plan(self, lengths: Sequence[int], cost: PassCost) -> list[list[int]]:
        return plan_sub_batches(lengths, cost.max_batch_tokens, cost.max_batch_size, 1, cost.pass_overhead_tokens)

    def prepare(self, rows: Sequence[ModelInput]) -> ImageInputs:
        pixels = torch.stack([row.image for row in rows]).to(self.device, self.dtype, non_blocking=True)
        grids = torch.tensor([row.grid for row in rows], device=self.device) if rows[0].grid else None
        return ImageInputs(pixels, rows[0].positions, grids)

    def run(self, inputs: ImageInputs, *, eager: bool = False) -> torch.Tensor:
        if inputs.grids is not None:
            features = self.tower(inputs.pixels, inputs.grids)
        elif self.graphs is not None and not eager:
            features = self.graphs.run(inputs.pixels)
        else:
            features = self.tower(inputs.pixels)
        return features.to(torch.float32)

    def computed_tokens(self, inputs: ImageInputs) -> int:
        rows = inputs.pixels.shape[0]
        if self.graphs is not None:
            return self.graphs.computed_tokens(rows, inputs.positions)
        return rows * inputs.positions

    @property
    def thread_counts(self) -> tuple[int, ...] | None:
        return getattr(self.tower, "thread_counts", None)  # ONNX Runtime's sessions are made per thread count

    def describe(self) -> dict[str, Any]:
        # OpenVINO's tower computes in bfloat16 on float32 pixels (backends/openvino_runtime.py).
        dtype = getattr(self.tower, "dtype", self.dtype)
        engine = self.tower.engine if dtype == self.dtype else \
            f"{self.tower.engine} {str(dtype).removeprefix('torch.')}"
        layout = "images stacked, each its own grid of patches padded to one count" if self.own_grid else \
            "images stacked, one size"
        return {"engine": engine, "layout": layout, "cuda_graphs": len(self.graphs.graphs) if self.graphs else 0}
