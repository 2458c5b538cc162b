"""Page images through a page retriever (model/pages.py): each image's ids (its image tokens and
the visual prompt) and pixels in one pass, a vector per position out.

ColPali's pages are all prepared to one size and the same ids, so its pass is a stack. ColQwen2's
keep their own sizes: a page's ids hold as many image tokens as its size gives, its pixel values
as many patches, so a pass is right-padded, both as ColQwen2Processor pads them, and the planner
cuts passes by the padded tokens as it does texts'. Right padding changes no vector: the language
model attends causally and the mask leaves the padding out.
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
    ids: torch.Tensor  # (rows, positions) right-padded, on the backend's device
    attention: torch.Tensor  # (rows, positions): 1 for each row's own positions
    pixels: torch.Tensor  # ColPali (rows, channels, height, width); ColQwen2 (rows, patches, values) right-padded
    grid: torch.Tensor | None  # ColQwen2: (rows, 3) each page's patches (temporal, rows, columns)


class PageBackend:
    def __init__(self, encoder: PageEncoder, *, dtype: torch.dtype, device: torch.device, pad_id: int = 0):
        self.encoder = encoder
        self.dtype = dtype
        self.device = device
        self.pad_id = pad_id

    def plan(self, lengths: Sequence[int], cost: PassCost) -> list[list[int]]:
        return plan_sub_batches(lengths, cost.max_batch_tokens, cost.max_batch_size, 1, cost.pass_overhead_tokens)

    def prepare(self, rows: Sequence[ModelInput]) -> PageInputs:
        longest = max(len(row.ids) for row in rows)
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row.ids)] = torch.tensor(row.ids, dtype=torch.long)
            attention[i, :len(row.ids)] = 1
        if rows[0].grid:
            pixels = torch.nn.utils.rnn.pad_sequence([row.image for row in rows], batch_first=True)
            grid = torch.tensor([row.grid for row in rows], dtype=torch.long).to(self.device)
        else:
            pixels, grid = torch.stack([row.image for row in rows]), None
        return PageInputs(ids.to(self.device, non_blocking=True), attention.to(self.device, non_blocking=True),
                          pixels.to(self.device, self.dtype, non_blocking=True), grid)

    def run(self, inputs: PageInputs, *, eager: bool = False) -> TokenVectors:
        vectors = self.encoder(inputs.ids, inputs.attention, inputs.pixels, inputs.grid).to(torch.float32)
        return TokenVectors(vectors, inputs.attention.sum(1).cpu())

    def computed_tokens(self, inputs: PageInputs) -> int:
        return inputs.ids.numel()

    @property
    def thread_counts(self) -> tuple[int, ...] | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"engine": "torch", "layout": "page images stacked, right-padded where sizes vary", "cuda_graphs": 0}
