"""A multi-vector (ColBERT) model's token vectors, as sentence-transformers' MultiVectorEncoder
computes them: every token's state through the Dense modules (per token), L2-normalized. Which
tokens a request gets back (the skiplist, query expansion) is the task's choice
(tasks/multi_vector.py); a pass returns every real and expansion token's vector.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from embedserve.handler.model.inputs import TokenRole
from embedserve.handler.model.pooling import l2_normalize


class TokenVectors(NamedTuple):
    vectors: torch.Tensor  # (rows, seq, dimension) float32, unit length; zeros on padding
    lengths: torch.Tensor  # (rows,): each row's tokens, expansion tokens included


class MultiVectorPooler(torch.nn.Module):
    """(batch, seq, hidden) states, the TokenRole mask and the ids -> TokenVectors."""

    def __init__(self, head: torch.nn.Module | None):
        super().__init__()
        self.head = head  # the Dense modules, applied to each token's state

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> TokenVectors:
        states = hidden.to(torch.float32)
        tokens = mask != TokenRole.PAD
        vectors = l2_normalize(self.head(states) if self.head is not None else states)
        return TokenVectors(vectors * tokens.unsqueeze(-1), tokens.sum(dim=1))
