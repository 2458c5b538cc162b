"""The modules of a sentence-transformers pipeline that transform the pooled vector: Dense (a
Linear, its activation, an optional residual), LayerNorm and Normalize, loaded from their folders'
safetensors and run in float32 on the model's device, after pooling, as sentence-transformers
runs them (LaBSE: CLS pooling, Dense with tanh, Normalize).

A Normalize that ends the pipeline is left to the answer (tasks/embed.py), which normalizes per
request: `"normalize": true` (the default) gives the pipeline's own unit vectors, `false` the
vector before that last step, as TEI serves it. A Normalize with modules after it stays.

A causal language model reranker's LogitScore is a head of the same kind: one Linear over the
last token's state (`logit_score_head`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from embedserve.handler.model.description import SENTENCE_EMBEDDING, HeadModule, LogitScore, ModelFilesError
from embedserve.handler.model.pooling import l2_normalize


class Dense(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, activation: torch.nn.Module,
                 residual: bool):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias)
        self.activation_function = activation  # sentence-transformers' name, so the weight names match
        self.use_residual = residual
        # A residual across a change of width goes through its own projection.
        self.residual = torch.nn.Linear(in_features, out_features, bias=False) \
            if residual and in_features != out_features else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation_function(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if self.residual is not None else x)
        return out


class Normalize(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_normalize(x)


class LayerNorm(torch.nn.Module):
    def __init__(self, dimension: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dimension)  # sentence-transformers' eps, 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def load_head(model_dir: Path, modules: Sequence[HeadModule], in_features: int,
              device: torch.device) -> tuple[torch.nn.Sequential | None, int]:
    """The modules in order but a final Normalize, weights loaded strictly (None when no module
    is left), and the width of the vector they give."""
    modules = without_final_normalize(modules)
    if not modules:
        return None, in_features
    layers = []
    width = in_features
    for module in modules:
        config = module.config
        if module.kind == "Dense":
            if config["in_features"] != width:
                raise ModelFilesError(f"{module.folder}: Dense takes {config['in_features']} features but the "
                                      f"pipeline gives it {width}")
            layer = Dense(width, config["out_features"], bool(config.get("bias", True)),
                          activation_class(config.get("activation_function"), module.folder)(),
                          bool(config.get("use_residual", False)))
            width = config["out_features"]
        elif module.kind == "LayerNorm":
            if config["dimension"] != width:
                raise ModelFilesError(f"{module.folder}: LayerNorm of {config['dimension']} features after a "
                                      f"{width}-feature vector")
            layer = LayerNorm(width)
        else:
            layer = Normalize()
        _load_weights(layer, model_dir / module.folder)
        layers.append(layer)
    return torch.nn.Sequential(*layers).to(device=device, dtype=torch.float32).eval(), width


def without_final_normalize(modules: Sequence[HeadModule]) -> list[HeadModule]:
    """The modules the encoder runs: the pipeline's, less the Normalize modules that end it."""
    modules = list(modules)
    while modules and modules[-1].kind == "Normalize":
        modules.pop()
    return modules


def _load_weights(layer: torch.nn.Module, folder: Path) -> None:
    expected = set(layer.state_dict())
    if not expected:
        return
    weights_file = folder / "model.safetensors"
    if not weights_file.is_file():
        raise ModelFilesError(f"{folder} has no model.safetensors for its {type(layer).__name__} module")
    state = load_file(str(weights_file))
    if set(state) != expected:
        raise ModelFilesError(f"{weights_file} holds {sorted(state)}; the {type(layer).__name__} module needs "
                              f"{sorted(expected)}")
    layer.load_state_dict(state)


def logit_score_head(model_dir: Path, score: LogitScore, device: torch.device) -> torch.nn.Linear:
    """A causal reranker's score as one Linear over the last token's state: the language model
    head's row of the true token less the false token's (logit[yes] - logit[no] is a difference
    of two dot products with the same state), in float32. Only those rows are read; a head tied
    to the input embeddings is read from them."""
    rows = [score.true_token_id] + ([score.false_token_id] if score.false_token_id is not None else [])
    weight, bias = _lm_head_rows(model_dir, rows)  # (1 or 2, hidden), (1 or 2,) or None
    sign = torch.tensor([1.0, -1.0][:len(rows)])
    layer = torch.nn.Linear(weight.shape[1], 1, bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(sign @ weight)
        if bias is not None:
            layer.bias.copy_((sign * bias).sum().reshape(1))
    return layer.to(device).eval()


def _lm_head_rows(model_dir: Path, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    config = json.loads((model_dir / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", True))  # transformers' default
    names = ["lm_head.weight"] + (["model.embed_tokens.weight", "embed_tokens.weight"] if tied else [])
    for weights_file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(weights_file), framework="pt") as weights:
            for name in (name for name in names if name in weights.keys()):
                table = weights.get_slice(name)
                weight = torch.stack([table[row] for row in rows]).to(torch.float32)
                bias = weights.get_tensor("lm_head.bias")[rows].to(torch.float32) \
                    if name == "lm_head.weight" and "lm_head.bias" in weights.keys() else None
                return weight, bias
    raise ModelFilesError(f"{model_dir}: no language model head ({' or '.join(names)}) in its safetensors; "
                          "LogitScore needs the logits of its true and false tokens")


def check_head_module(module: HeadModule, where: str, feature: str = SENTENCE_EMBEDDING) -> HeadModule:
    """The module, checked to read and write `feature` (the pooled vector; a multi-vector model's
    Dense modules work on each token's, "token_embeddings") and to name what it needs."""
    config = module.config
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, feature) not in (feature, None):
            raise ModelFilesError(f"{where}: {key} '{config[key]}' is not '{feature}'; not supported")
    if module.kind == "Dense":
        for key in ("in_features", "out_features"):
            if not isinstance(config.get(key), int):
                raise ModelFilesError(f"{where}: config.json has no integer '{key}'")
        activation_class(config.get("activation_function"), where)
    if module.kind == "LayerNorm" and not isinstance(config.get("dimension"), int):
        raise ModelFilesError(f"{where}: config.json has no integer 'dimension'")
    return module


def activation_class(name: str | None, where: str = "Dense") -> type:
    """A Dense module's activation: a torch.nn module class by its full name, as
    sentence-transformers trusts without remote code; Tanh when the config names none."""
    import torch

    if name is None:
        return torch.nn.Tanh
    cls = getattr(torch.nn, name.rsplit(".", 1)[-1], None) if name.startswith("torch.nn.") else None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ModelFilesError(f"{where}: activation_function '{name}' is not a torch.nn module; not supported")
    return cls
