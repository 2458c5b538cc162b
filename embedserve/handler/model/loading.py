"""The torch model: loaded from safetensors on the worker's device and dtype, as one padded
forward callable.

SDPA attention where the architecture has it (eager otherwise); no key/value cache; int8 (CPU)
quantizes the Linear layers dynamically; `compile` wraps the model in torch.compile. The padded
forward hands BERT-family encoders a 4D mask built without a host read (embedserve/handler/model/attention_mask.py).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification
from transformers.utils import logging as transformers_logging

from embedserve.handler.model.attention_mask import mask_builder

log = logging.getLogger(__name__)

# Loading progress bars are noise in a server's log.
transformers_logging.disable_progress_bar()


def load_model(model_dir: Path, *, device: torch.device, dtype: torch.dtype,
               int8_fp32_layers: Sequence[str] | None = None, compile: bool = False,
               scoring: bool = False, masked_lm: bool = False) -> torch.nn.Module:
    """The model on `device` in `dtype`; with `int8_fp32_layers` (CPU), its Linear layers but
    those quantized to int8; with `compile`, wrapped in torch.compile. `scoring`: the model
    with its sequence-classification head (a reranker's or classifier's logits); `masked_lm`: with
    its masked-language-model head (SPLADE's vocabulary logits)."""
    kwargs = dict(dtype=dtype, use_safetensors=True)
    auto = AutoModelForSequenceClassification if scoring else AutoModelForMaskedLM if masked_lm else AutoModel
    try:
        model = auto.from_pretrained(model_dir, attn_implementation="sdpa", **kwargs)
    except (ValueError, ImportError) as err:  # architectures without SDPA support
        log.warning("SDPA attention unavailable (%s); using eager attention", err)
        model = auto.from_pretrained(model_dir, **kwargs)
    model = model.to(device).eval()
    # An embedding pass never decodes further: a key/value cache (Qwen3 and other decoders
    # build one by default) would only hold every layer's keys and values to the pass's end.
    model.config.use_cache = False
    if int8_fp32_layers is not None:
        model = quantize_int8(model, keep_fp32=int8_fp32_layers)
    if compile:
        model = torch.compile(model, dynamic=True)
    return model


class TorchTransformer:
    """(batch, seq) ids and attention mask -> (batch, seq, hidden) states of a torch model, or
    (batch, labels) logits of a sequence-classification model; token type ids where given."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.scoring = is_scoring(model)
        # None: the model builds its own mask. A classifier hands its mask on to its base model.
        self.attention_mask = mask_builder(getattr(model, "base_model", model) if self.scoring else model)

    @property
    def attention(self) -> str:
        """The attention implementation the model runs, for /info."""
        config = getattr(self.model, "_orig_mod", self.model).config
        return getattr(config, "_attn_implementation", None) or "eager"

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if self.attention_mask is not None:
            attention = self.attention_mask(attention)  # (batch, 1, seq, seq): no host read
        extra = {} if segments is None else {"token_type_ids": segments}
        out = self.model(input_ids=ids, attention_mask=attention, **extra)
        return out.logits if self.scoring else out.last_hidden_state


def is_scoring(model: torch.nn.Module) -> bool:
    """Whether the model ends in a sequence-classification head (its output is logits)."""
    return type(getattr(model, "_orig_mod", model)).__name__.endswith("ForSequenceClassification")


def quantizable_layers(model: torch.nn.Module) -> list[str]:
    """The Linear layers int8 mode may quantize (the unused BERT pooler is left alone)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not name.startswith("pooler")]


def quantize_int8(model: torch.nn.Module, keep_fp32: Sequence[str] = ()) -> torch.nn.Module:
    """Dynamic int8 quantization (per-channel weights, activations quantized per call) of every
    quantizable Linear but those in keep_fp32. Weights shrink 4x and matmuls run on int8 kernels."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    unknown = set(keep_fp32) - set(quantizable_layers(model))
    if unknown:
        raise ValueError(f"handler setting 'int8_fp32_layers': no such Linear layer(s): {', '.join(sorted(unknown))}")
    chosen = {name: per_channel_dynamic_qconfig for name in quantizable_layers(model) if name not in keep_fp32}
    with warnings.catch_warnings():  # torch points eager quantization users at torchao on every call
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, chosen, dtype=torch.qint8)
