"""Images through an image-text model's vision tower: torch's (model/towers.py), or its ONNX
export on a CPU, in float32 on ONNX Runtime (backends/onnx_runtime.py) or in bfloat16 on OpenVINO
(backends/openvino_runtime.py).

Every image is prepared to the same size (inputs/image.py), so a pass is a stack of pixel values
and costs the same positions an image: the planner cuts passes by count and the token budget
alone, never by padding (there is none).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from embedserve.handler.backends.base import PassCost
from embedserve.handler.backends.onnx_runtime import OnnxImageTower
from embedserve.handler.backends.openvino_runtime import OpenVinoImageTower
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.towers import ImageTower
from embedserve.handler.scheduling.planner import plan_sub_batches


class ImageInputs(NamedTuple):
    pixels: torch.Tensor  # (rows, channels, height, width) on the backend's device, in its dtype
    positions: int  # the patches each image costs


class VisionBackend:
    def __init__(self, tower: ImageTower | OnnxImageTower | OpenVinoImageTower, *, dtype: torch.dtype,
                 device: torch.device):
        self.tower = tower
        self.dtype = dtype
        self.device = device

    def plan(self, lengths: Sequence[int], cost: PassCost) -> list[list[int]]:
        return plan_sub_batches(lengths, cost.max_batch_tokens, cost.max_batch_size, 1, cost.pass_overhead_tokens)

    def prepare(self, rows: Sequence[ModelInput]) -> ImageInputs:
        pixels = torch.stack([row.image for row in rows]).to(self.device, self.dtype, non_blocking=True)
        return ImageInputs(pixels, rows[0].positions)

    def run(self, inputs: ImageInputs, *, eager: bool = False) -> torch.Tensor:
        return self.tower(inputs.pixels).to(torch.float32)

    def computed_tokens(self, inputs: ImageInputs) -> int:
        return inputs.pixels.shape[0] * inputs.positions

    @property
    def thread_counts(self) -> tuple[int, ...] | None:
        return getattr(self.tower, "thread_counts", None)  # ONNX Runtime's sessions are made per thread count

    def describe(self) -> dict[str, Any]:
        # OpenVINO's tower computes in bfloat16 on float32 pixels (backends/openvino_runtime.py).
        dtype = getattr(self.tower, "dtype", self.dtype)
        engine = self.tower.engine if dtype == self.dtype else \
            f"{self.tower.engine} {str(dtype).removeprefix('torch.')}"
        return {"engine": engine, "layout": "images stacked, one size", "cuda_graphs": 0}
