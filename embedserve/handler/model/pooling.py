"""Pooling token states into one vector per sequence, as sentence-transformers' Pooling does, and
L2 normalization.

Inputs are right-padded: `hidden` is (batch, seq, hidden) and `mask` is (batch, seq), each
position's TokenRole (model/inputs.py); pooling uses the POOLED ones (a Pooling module with
`include_prompt: false` leaves out the PROMPT tokens, as sentence-transformers zeroes them in its
pooling mask).
Several modes are concatenated in the order given. Pooling accumulates in float32 whatever the
model's dtype, so half-precision models do not lose precision in the sum.
"""

from __future__ import annotations

from typing import Sequence

import torch

from embedserve.handler.model.description import POOLING_MODES
from embedserve.handler.model.inputs import TokenRole


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """(batch, seq, hidden) x (batch, seq) -> (batch, hidden * len(modes)) float32."""
    # Each tensor operation costs microseconds on a small pass: none is made that the modes do not use.
    states = hidden if hidden.dtype == torch.float32 else hidden.to(torch.float32)
    pooled = (mask == TokenRole.POOLED).unsqueeze(-1)  # (batch, seq, 1)
    weights = pooled.to(torch.float32)
    outputs = []
    for mode in modes:
        if mode == "cls":  # the first pooled token: [CLS], or the first after an excluded prompt
            outputs.append(states[_rows(hidden), pooled.squeeze(-1).to(torch.int32).argmax(dim=1)])
        elif mode == "max":
            outputs.append(states.masked_fill(~pooled, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            count = weights.sum(dim=1).clamp(min=1e-9)  # (batch, 1)
            outputs.append((states * weights).sum(dim=1) / (count if mode == "mean" else count.sqrt()))
        elif mode == "weightedmean":  # token i weighs i + 1 (counted from the first token, prompt included)
            positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=torch.float32)
            weighted = weights * positions.view(1, -1, 1)
            outputs.append((states * weighted).sum(dim=1) / weighted.sum(dim=1).clamp(min=1e-9))
        elif mode == "last_token":  # a row without pooled tokens gives zeros, as sentence-transformers does
            last = hidden.shape[1] - 1 - pooled.squeeze(-1).flip(1).to(torch.int32).argmax(dim=1)
            outputs.append((states * weights)[_rows(hidden), last])
        else:
            raise ValueError(f"unknown pooling mode '{mode}'; known: {', '.join(POOLING_MODES)}")
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def _rows(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[0], device=hidden.device)


def l2_normalize(vectors: torch.Tensor) -> torch.Tensor:
    """torch.nn.functional.normalize(vectors, p=2.0, dim=-1), the same operations without its Python
    wrappers (torch.norm sorting out its arguments), which cost more than the operations on a batch."""
    return vectors / torch.linalg.vector_norm(vectors, 2.0, dim=-1, keepdim=True).clamp_min(1e-12)
