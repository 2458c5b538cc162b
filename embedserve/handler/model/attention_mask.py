"""The attention mask of a padded pass, built the way the model builds it, but with no host read.

Given a 2D mask, transformers 5 first asks whether it has any padding at all
(`padding_mask.all()` in `masking_utils`), to skip the mask when there is none: a read of the
device into Python, so a GPU pass waits for every kernel queued before it, once per pass, against
the "one synchronization per batch" design (embedserve/handler/execution/encoder.py). A model given an already built 4D
mask uses it as it is. So for the encoders whose forward hands the 2D mask to
`create_bidirectional_mask` and to nothing else, the encoder builds that 4D mask itself, with the
same function and the skip turned off: the same mask the model would build (a boolean one for
SDPA, an additive one for eager attention), and a padding-free pass gets an all-true mask
instead of none, which changes no value. Inside a CUDA graph capture transformers skips the
read itself (it sees the capture), but the capture's sync check runs the forward eagerly first
(backends/cuda_graphs.py's `forward_synchronizes`) and refuses a forward that reads.

Those encoders: BERT, RoBERTa, XLM-R, MPNet, and the native ports of nomic-bert, GTE v1.5 /
Arctic-m-v2 and EuroBERT (their forwards were read in transformers 5.24: the 2D mask goes to
`create_bidirectional_mask` alone). Qwen3 and ModernBERT take a dict of masks by layer type (as
`generate` prepares them), which the encoder builds as their forwards do: Qwen3's causal masks
(and sliding-window ones where its config has such layers), ModernBERT's global and sliding-window
bidirectional masks. Without it each forward read the device on every pass, which a CUDA graph
capture refuses (the sync check at capture, on an H100), so they got no graphs. A bidirectional
Gemma3 (EmbeddingGemma) reads nothing back, but its full-attention overlay copies a host tensor in
on every pass (`torch.tensor(True)`), which a capture refuses too: its masks are built here with
the same overlays, that constant made on the device.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

# (batch, seq) mask of 1 and 0 -> what the model's forward takes as its mask: a (batch, 1, seq,
# seq) mask, or a dict of them by layer type.
MaskBuilder = Callable[[torch.Tensor], Union[torch.Tensor, dict]]


def _masks():
    """transformers' mask functions, imported with a torch model at hand: with this module they
    cost every worker's start about 1.1 s of CPU (they import torch._dynamo), which a worker that
    runs ONNX Runtime or OpenVINO never needs."""
    from transformers import masking_utils

    return masking_utils


def _bidirectional(model: torch.nn.Module) -> MaskBuilder:
    config, dtype, masks = model.config, model.dtype, _masks()

    def build(mask: torch.Tensor) -> torch.Tensor:
        return masks.create_bidirectional_mask(config=config, inputs_embeds=_embeds(mask, dtype), attention_mask=mask,
                                               allow_is_bidirectional_skip=False)

    return build


def _qwen3(model: torch.nn.Module) -> MaskBuilder:
    config, dtype, sliding, masks = model.config, model.dtype, model.has_sliding_layers, _masks()

    def build(mask: torch.Tensor) -> dict:
        embeds = _embeds(mask, dtype)
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)  # as its forward makes them
        common = dict(config=config, inputs_embeds=embeds, attention_mask=mask, cache=None, position_ids=positions,
                      allow_is_causal_skip=False)
        built = {"full_attention": masks.create_causal_mask(**common)}
        if sliding:
            built["sliding_attention"] = masks.create_sliding_window_causal_mask(**common)
        return built

    return build


def _modernbert(model: torch.nn.Module) -> MaskBuilder:
    config, dtype, masks = model.config, model.dtype, _masks()

    def build(mask: torch.Tensor) -> dict:
        common = dict(config=config, inputs_embeds=_embeds(mask, dtype), attention_mask=mask,
                      allow_is_bidirectional_skip=False)
        return {"full_attention": masks.create_bidirectional_mask(**common),
                "sliding_attention": masks.create_bidirectional_sliding_window_mask(**common)}

    return build


def _gemma3(model: torch.nn.Module) -> MaskBuilder | None:
    from transformers.models.gemma3 import modeling_gemma3

    config, dtype, masks = model.config, model.dtype, _masks()
    window_overlay = getattr(modeling_gemma3, "_bidirectional_window_overlay", None)
    if not getattr(config, "use_bidirectional_attention", False) or window_overlay is None:
        return None  # a causal Gemma3, or a transformers that builds its masks otherwise

    def build(mask: torch.Tensor) -> dict:
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
        common = dict(config=config, inputs_embeds=_embeds(mask, dtype), attention_mask=mask, cache=None,
                      position_ids=positions)
        everywhere = torch.ones((), dtype=torch.bool, device=mask.device)  # the forward's torch.tensor(True)
        return {"full_attention": masks.create_causal_mask(**common, or_mask_function=lambda *args: everywhere),
                "sliding_attention": masks.create_sliding_window_causal_mask(
                    **common, or_mask_function=window_overlay(config.sliding_window))}

    return build


def _embeds(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Only the shape, dtype and device of the embeddings are read: an empty stand-in.
    return torch.empty((*mask.shape, 0), dtype=dtype, device=mask.device)


# Exact classes, transformers' own (a subclass, or a folder's code of the same name, may build its
# mask otherwise), by name: an older transformers (setup.cfg allows 5.0) may lack one.
BUILDERS: dict[str, tuple[str, Callable[[torch.nn.Module], MaskBuilder | None]]] = {
    "BertModel": ("bert", _bidirectional), "RobertaModel": ("roberta", _bidirectional),
    "XLMRobertaModel": ("xlm_roberta", _bidirectional), "MPNetModel": ("mpnet", _bidirectional),
    "NomicBertModel": ("nomic_bert", _bidirectional), "GteModel": ("gte", _bidirectional),
    "EuroBertModel": ("eurobert", _bidirectional),
    "Qwen3Model": ("qwen3", _qwen3), "ModernBertModel": ("modernbert", _modernbert),
    "Gemma3TextModel": ("gemma3", _gemma3),
}


def mask_builder(model: torch.nn.Module) -> MaskBuilder | None:
    """What builds `model`'s mask without a host read, or None where the model must build it."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    cls = type(model)
    known = BUILDERS.get(cls.__name__)
    if known is None or cls.__module__ != f"transformers.models.{known[0]}.modeling_{known[0]}":
        return None
    if known[1] is _bidirectional and getattr(model.config, "is_decoder", False):
        return None
    return known[1](model)
