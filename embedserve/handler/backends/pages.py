"""Page images through a page retriever (model/pages.py): each image's ids (its image tokens and
the visual prompt, the same for every page) and pixels in one pass, a vector per position out.

Every page is prepared to the same size and the same ids, so a pass is a stack: the planner cuts
passes by count and the token budget alone, never by padding (there is none).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from embedserve.handler.backends.base import PassCost
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.multi_vector import TokenVectors
from embedserve.handler.model.pages import PageEncoder
from embedserve.handler.scheduling.planner import plan_sub_batches


class PageInputs(NamedTuple):
    ids: torch.Tensor  # (rows, positions) on the backend's device
    pixels: torch.Tensor  # (rows, channels, height, width) on the backend's device, in its dtype


class PageBackend:
    def __init__(self, encoder: PageEncoder, *, dtype: torch.dtype, device: torch.device):
        self.encoder = encoder
        self.dtype = dtype
        self.device = device

    def plan(self, lengths: Sequence[int], cost: PassCost) -> list[list[int]]:
        return plan_sub_batches(lengths, cost.max_batch_tokens, cost.max_batch_size, 1, cost.pass_overhead_tokens)

    def prepare(self, rows: Sequence[ModelInput]) -> PageInputs:
        ids = torch.tensor([list(row.ids) for row in rows], dtype=torch.long).to(self.device, non_blocking=True)
        pixels = torch.stack([row.image for row in rows]).to(self.device, self.dtype, non_blocking=True)
        return PageInputs(ids, pixels)

    def run(self, inputs: PageInputs, *, eager: bool = False) -> TokenVectors:
        vectors = self.encoder(inputs.ids, torch.ones_like(inputs.ids), inputs.pixels).to(torch.float32)
        return TokenVectors(vectors, torch.full((inputs.ids.shape[0],), inputs.ids.shape[1], dtype=torch.long))

    def computed_tokens(self, inputs: PageInputs) -> int:
        return inputs.ids.numel()

    @property
    def thread_counts(self) -> tuple[int, ...] | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"engine": "torch", "layout": "page images stacked, one size", "cuda_graphs": 0}
