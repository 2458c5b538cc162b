"""SPLADE pooling: a masked-language model's vocabulary logits at every token, made sparse, one
weight per vocabulary entry, as sentence-transformers' SpladePooling computes them.

The logits are (batch, seq, vocabulary): 30,522 floats a token for BERT, 250,002 for XLM-R, so a
pass of 256 inputs of 512 tokens would hold 16 GB of them at once. They are computed a block of
(inputs, positions) at a time, each block at most CHUNK_VALUES floats, and reduced into the
(batch, vocabulary) result as they go; the pooled rows are all a pass keeps.
"""

from __future__ import annotations

import torch

from embedserve.handler.model.description import ModelFilesError, SparsePooling

# The most logits one block holds: 64 MiB in float32, whatever the pass's size.
CHUNK_VALUES = 1 << 24


class SpladePooler(torch.nn.Module):
    """(batch, seq, hidden) token states and the TokenRole mask -> (batch, vocabulary) float32
    weights: relu, log1p (twice for log1p_relu), then max or sum over the input's tokens. Every
    real token counts, special tokens and prompt included, as SpladePooling's attention mask does."""

    def __init__(self, mlm_head: torch.nn.Module, pooling: SparsePooling, chunk_values: int = CHUNK_VALUES):
        super().__init__()
        self.mlm_head = mlm_head
        self.pooling = pooling
        self.chunk_values = chunk_values

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, _ = hidden.shape
        vocabulary = self.pooling.vocabulary
        out = torch.zeros((batch, vocabulary), dtype=torch.float32, device=hidden.device)
        real = (mask > 0).unsqueeze(-1)  # (batch, seq, 1)
        rows = max(1, min(batch, self.chunk_values // vocabulary))
        positions = max(1, self.chunk_values // (rows * vocabulary))
        for first in range(0, batch, rows):
            block = slice(first, first + rows)
            for start in range(0, length, positions):
                span = slice(start, start + positions)
                weights = self.mlm_head(hidden[block, span]).to(torch.float32).relu_().log1p_()
                if self.pooling.activation == "log1p_relu":
                    weights.log1p_()
                weights.mul_(real[block, span])  # padding weighs 0: below every real weight, which is >= 0
                if self.pooling.strategy == "max":
                    out[block] = torch.maximum(out[block], weights.amax(dim=1))
                else:
                    out[block] += weights.sum(dim=1)
                del weights  # before the next block is computed: one block at a time, not two
        return out


def masked_lm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A masked-language model's encoder (token states out) and its head (states to vocabulary
    logits), for architectures whose head is one module beside the encoder (BERT's `cls`,
    RoBERTa's and XLM-R's `lm_head`); others are refused with the modules they have."""
    base = model.base_model
    others = [(name, module) for name, module in model.named_children() if module is not base]
    if len(others) != 1:
        names = ", ".join(name for name, _ in others)
        raise ModelFilesError(f"{type(model).__name__}: its masked-language-model head is not one module beside "
                              f"the encoder ({names}); SPLADE is served for BERT- and RoBERTa-style heads")
    return base, others[0][1]
