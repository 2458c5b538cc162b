"""bge-m3's three outputs from one pass, as FlagEmbedding's BGEM3 computes them:

- dense: the sentence-transformers pipeline (CLS pooling; its final Normalize is left to the
  answer, as for every dense model);
- sparse: relu(sparse_linear(h)) at each token, one weight a token; the rows collector
  (execution/encoder.py's HybridRows) merges them by token id with max, leaving out the
  tokenizer's cls, eos, pad and unk tokens, as FlagEmbedding does;
- ColBERT: colbert_linear(h) at every token after the first, L2-normalized; padding gives zeros.

The heads are the build's safetensors of the folder's `sparse_linear.pt` and `colbert_linear.pt`
(archive/stage.py), run in float32 on the model's device.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from embedserve.handler.model.description import M3Heads, ModelFilesError
from embedserve.handler.model.inputs import TokenRole
from embedserve.handler.model.pooling import l2_normalize, pool


class M3Output(NamedTuple):
    """One pass's outputs, row by row."""
    dense: torch.Tensor  # (rows, dimension) float32, before the final Normalize
    token_weights: torch.Tensor  # (rows, seq) float32: each token's sparse weight, 0 on padding
    ids: torch.Tensor  # (rows, seq): the pass's token ids, to merge the weights by
    colbert: torch.Tensor  # (rows, seq - 1, colbert dimension) float32: each token after the first's vector
    lengths: torch.Tensor  # (rows,): each row's real tokens


class M3Pooler(torch.nn.Module):
    """(batch, seq, hidden) states, the TokenRole mask and the ids -> M3Output."""

    def __init__(self, modes: tuple[str, ...], head: torch.nn.Module | None, sparse_linear: torch.nn.Linear,
                 colbert_linear: torch.nn.Linear):
        super().__init__()
        self.modes = modes
        self.head = head
        self.sparse_linear = sparse_linear
        self.colbert_linear = colbert_linear

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> M3Output:
        dense = pool(hidden, mask, self.modes)
        if self.head is not None:
            dense = self.head(dense)
        states = hidden.to(torch.float32)
        tokens = mask != TokenRole.PAD
        real = tokens.unsqueeze(-1).to(torch.float32)  # (batch, seq, 1)
        weights = torch.relu(self.sparse_linear(states)).mul_(real).squeeze(-1)
        colbert = l2_normalize(self.colbert_linear(states[:, 1:]) * real[:, 1:])
        return M3Output(dense, weights, ids, colbert, tokens.sum(dim=1))


def load_m3_heads(model_dir: Path, heads: M3Heads, width: int, device: torch.device
                  ) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """The sparse and ColBERT Linear layers, loaded strictly from the staged safetensors."""
    layers = []
    for name, out_features in (("sparse_linear", 1), ("colbert_linear", heads.colbert_dimension)):
        layer = torch.nn.Linear(width, out_features)
        state = load_file(str(model_dir / f"{name}.safetensors"))
        expected = {key: tuple(value.shape) for key, value in layer.state_dict().items()}
        if {key: tuple(value.shape) for key, value in state.items()} != expected:
            raise ModelFilesError(f"{model_dir / name}.safetensors holds "
                                  f"{ {key: tuple(v.shape) for key, v in state.items()} }; expected {expected}")
        layer.load_state_dict(state)
        layers.append(layer.to(device=device, dtype=torch.float32).eval())
    return layers[0], layers[1]
