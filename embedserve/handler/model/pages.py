"""Page retrievers (ColPali: transformers' ColPaliForRetrieval): a vision-language model that gives
a vector per position of a page image or of a query, the two compared by MaxSim, as ColBERT's
tokens are (tasks/multi_vector.py).

What the folder says (`read_pages`): the vectors' width (`embedding_dim`), the image tokens a page
costs (the image processor's `image_seq_length`: the vision tower's patches, each projected into
the language model), and the processor's two prompts. transformers 5 saves the image processor
inside `processor_config.json`; earlier releases saved `preprocessor_config.json` beside it.

How an input becomes ids, as ColPaliProcessor makes them (`page_text`, `query_text`, tokenized as
one string without further special tokens):
- a page image: the image token once per patch, then "<bos>" + the visual prompt ("Describe the
  image.") + "\\n"; its pixels by the folder's image processor (inputs/image.py);
- a query: "<bos>" + the query prefix ("Question: ") + the text + ten pad tokens (the query
  augmentation, attended to and answered like any token) + "\\n".

Every position the mask attends to gives a vector: the language model's last states through
`embedding_proj_layer`, L2-normalized (`PageEncoder`, transformers' own forward, so the vectors are
the reference's by construction).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from embedserve.handler.model.description import ModelFilesError, Pages

SERVED = {"ColPaliForRetrieval": "colpali"}
QUERY_AUGMENTATION = 10  # ColPaliProcessor's pad tokens after a query


def read_pages(model_dir: Path, config: dict[str, Any]) -> Pages:
    """A page retriever's facts, or the reason it is not served."""
    architecture = str((config.get("architectures") or [""])[0])
    if SERVED.get(architecture) != config.get("model_type"):
        raise ModelFilesError(f"'{config.get('model_type', '?')}' ({architecture or 'no architectures'}) is a page "
                              "retriever (a vector per image patch and per query token, scored by MaxSim) that is "
                              "not served: ColPaliForRetrieval is; see docs/models.md")
    from transformers import AutoConfig  # published configs leave out the values that are its defaults

    read = AutoConfig.from_pretrained(model_dir)
    vision = read.vlm_config.vision_config
    processor = _processor_files(model_dir)
    image_tokens = processor["image"].get("image_seq_length")
    patches = (vision.image_size // vision.patch_size) ** 2
    if image_tokens != patches:
        raise ModelFilesError(f"{model_dir}: the image processor's image_seq_length is {image_tokens}, the vision "
                              f"tower computes {patches} patches ({vision.image_size} px in {vision.patch_size} px "
                              "patches): a page's image tokens would not match its patches")
    return Pages(architecture, read.embedding_dim, image_tokens, read.vlm_config.text_config.max_position_embeddings,
                 processor["processor"].get("visual_prompt_prefix", "Describe the image."),
                 processor["processor"].get("query_prefix", "Question: "))


def _processor_files(model_dir: Path) -> dict[str, dict[str, Any]]:
    """The processor's settings and its image processor's, from either layout."""
    processor_file, image_file = model_dir / "processor_config.json", model_dir / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
    image = processor.get("image_processor") or (json.loads(image_file.read_text()) if image_file.is_file() else None)
    if not image:
        raise ModelFilesError(f"{model_dir} has no image processor settings (processor_config.json's "
                              "image_processor, or preprocessor_config.json)")
    return {"processor": processor, "image": image}


def page_text(pages: Pages, bos: str) -> str:
    """What a page image's ids are made of: its image tokens and the visual prompt."""
    return f"{pages.image_token * pages.image_tokens}{bos}{pages.visual_prompt}\n"


def query_text(pages: Pages, bos: str, pad: str, text: str) -> str:
    """What a query's ids are made of: the prefix, the text and the query augmentation."""
    return f"{bos}{pages.query_prefix}{text}{pad * QUERY_AUGMENTATION}\n"


class PageEncoder:
    """(batch, seq) right-padded ids and attention mask, with (batch, channels, height, width)
    pixel values for a pass of page images -> (batch, seq, dimension) vectors, zero where the mask
    is. A pass is all page images or all queries: the image tokens of its rows take its pixels."""

    engine = "torch"

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, pixels: torch.Tensor | None = None
                 ) -> torch.Tensor:
        # Token types all 0, as ColPaliProcessor gives them: PaliGemma attends over such a prefix both
        # ways; without them a query's positions would attend causally.
        return self.model(input_ids=ids, attention_mask=attention, pixel_values=pixels,
                          token_type_ids=torch.zeros_like(ids)).embeddings


def load_pages_model(model_dir: Path, *, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' ColPaliForRetrieval on `device` in `dtype`."""
    from transformers import ColPaliForRetrieval

    return ColPaliForRetrieval.from_pretrained(model_dir, dtype=dtype, use_safetensors=True).to(device).eval()


class PageQueries:
    """A padded backend's transformer for a page retriever's queries: (batch, seq) ids and mask ->
    (batch, seq, dimension) vectors (backends/padded.py hands them to MultiVectorPooler)."""

    attention = "transformers' own"

    def __init__(self, encoder: PageEncoder):
        self.encoder = encoder

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> torch.Tensor:
        return self.encoder(ids, attention)
