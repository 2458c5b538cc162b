"""Pooling token states into one vector per sequence, and L2 normalization.

Inputs are right-padded: `hidden` is (batch, seq, hidden), `mask` is (batch, seq) with 1 for
real tokens. Pooling accumulates in float32 whatever the model's dtype, so half-precision
models do not lose precision in the sum.
"""

from __future__ import annotations

import torch

POOLING_MODES = ("mean", "cls", "last_token")


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """(batch, seq, hidden) x (batch, seq) -> (batch, hidden) float32."""
    if mode == "mean":
        weights = mask.unsqueeze(-1).to(torch.float32)  # (batch, seq, 1)
        summed = (hidden.to(torch.float32) * weights).sum(dim=1)
        return summed / weights.sum(dim=1).clamp(min=1.0)
    if mode == "cls":
        return hidden[:, 0].to(torch.float32)
    if mode == "last_token":
        last = mask.sum(dim=1).to(torch.long) - 1  # index of each row's last real token
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden[rows, last].to(torch.float32)
    raise ValueError(f"unknown pooling mode '{mode}'; known: {', '.join(POOLING_MODES)}")


def l2_normalize(vectors: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
