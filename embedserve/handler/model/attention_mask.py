"""The attention mask of a padded pass, built the way the model builds it, but with no host read.

Given a 2D mask, transformers 5 first asks whether it has any padding at all
(`padding_mask.all()` in `masking_utils`), to skip the mask when there is none: a read of the
device into Python, so a GPU pass waits for every kernel queued before it, once per pass, against
the "one synchronization per batch" design (embedserve/handler/execution/encoder.py). A model given an already built 4D
mask uses it as it is. So for the encoders whose forward hands the 2D mask to
`create_bidirectional_mask` and to nothing else, the encoder builds that 4D mask itself, with the
same function and the skip turned off: the same mask the model would build (a boolean one for
SDPA, an additive one for eager attention), and a padding-free pass gets an all-true mask
instead of none, which changes no value. A CUDA graph capture already skips the read
(transformers sees the capture), so replayed passes were never affected.

Those encoders: BERT, RoBERTa, XLM-R, MPNet, and the native ports of nomic-bert, GTE v1.5 /
Arctic-m-v2 and EuroBERT (their forwards were read in transformers 5.24: the 2D mask goes to
`create_bidirectional_mask` alone). Without it their forward read the device on every pass, which a
CUDA graph capture refuses (the sync check at capture, on an H100), so they got no graphs. Other
architectures (ModernBERT's and EmbeddingGemma's sliding-window masks, decoders' causal masks) keep
building their own mask, with the read.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import BertModel, MPNetModel, RobertaModel, XLMRobertaModel
from transformers.masking_utils import create_bidirectional_mask

# Exact classes: a subclass may build its mask otherwise. The native ports by name, transformers'
# own: an older transformers (setup.cfg allows 5.0) may lack one.
PLAIN_BIDIRECTIONAL = (BertModel, RobertaModel, XLMRobertaModel, MPNetModel)
PLAIN_BIDIRECTIONAL_PORTS = {"NomicBertModel": "nomic_bert", "GteModel": "gte", "EuroBertModel": "eurobert"}

# (batch, seq) mask of 1 and 0 -> the mask the model's attention takes, (batch, 1, seq, seq).
MaskBuilder = Callable[[torch.Tensor], torch.Tensor]


def mask_builder(model: torch.nn.Module) -> MaskBuilder | None:
    """What builds `model`'s 4D mask without a host read, or None where the model must build it."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if not _plain_bidirectional(type(model)) or getattr(model.config, "is_decoder", False):
        return None
    config, dtype = model.config, model.dtype

    def build(mask: torch.Tensor) -> torch.Tensor:
        # Only the shape, dtype and device of the embeddings are read: an empty stand-in.
        embeds = torch.empty((*mask.shape, 0), dtype=dtype, device=mask.device)
        return create_bidirectional_mask(config=config, inputs_embeds=embeds, attention_mask=mask,
                                         allow_is_bidirectional_skip=False)

    return build


def _plain_bidirectional(cls: type) -> bool:
    port = PLAIN_BIDIRECTIONAL_PORTS.get(cls.__name__)
    return cls in PLAIN_BIDIRECTIONAL or (port is not None
                                          and cls.__module__ == f"transformers.models.{port}.modeling_{port}")
