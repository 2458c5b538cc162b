"""Page retrievers (transformers' ColPaliForRetrieval and ColQwen2ForRetrieval): a
vision-language model that gives a vector per position of a page image or of a query, the two
compared by MaxSim, as ColBERT's tokens are (tasks/multi_vector.py).

What the folder says (`read_pages`): the vectors' width (`embedding_dim`), the image tokens a page
costs, and the processor's two prompts. transformers 5 saves the image processor inside
`processor_config.json`; earlier releases saved `preprocessor_config.json` beside it.
- ColPali resizes every page to one size: its image tokens are the image processor's
  `image_seq_length`, the vision tower's patches (checked against them).
- ColQwen2 keeps a page's aspect ratio: Qwen2-VL's image processor resizes it to a multiple of
  28 px within its pixel bounds, and 2 x 2 of its 14 px patches make one image token, so a page's
  tokens follow its size (its `grid` of patches, inputs/image.py): the pixel bound's at most, but
  for a long strip, whose short side stays one token wide where the bound would shrink it below.

How an input becomes ids, as the processors make them (`PageIds`, `query_text`, tokenized as
one string without further special tokens):
- a ColPali page: the image token once per image token, then "<bos>" + the visual prompt
  ("Describe the image.") + "\\n"; a query: "<bos>" + the query prefix ("Question: ") + the text +
  ten pad tokens (the query augmentation, attended to and answered like any token) + "\\n";
- a ColQwen2 page: the visual prompt ("<|im_start|>user\\n<|vision_start|><|image_pad|>
  <|vision_end|>Describe the image.<|im_end|><|endoftext|>"), its image token repeated once per
  image token; a query: as ColPali's without "<bos>" (Qwen2's tokenizer has none), its prefix
  "Query: ".

Every position the mask attends to gives a vector: the language model's last states through
`embedding_proj_layer`, L2-normalized (`PageEncoder`, transformers' own forward, so the vectors are
the reference's by construction).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Sequence

import torch

from embedserve.handler.model.description import ModelFilesError, Pages
from embedserve.handler.model.image_processor import image_processor

SERVED = {"ColPaliForRetrieval": "colpali", "ColQwen2ForRetrieval": "colqwen2"}  # architecture: model_type
QUERY_AUGMENTATION = 10  # the processors' pad tokens after a query
QWEN2_VL_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|><|endoftext|>"


def read_pages(model_dir: Path, config: dict[str, Any]) -> Pages:
    """A page retriever's facts, or the reason it is not served."""
    architecture = str((config.get("architectures") or [""])[0])
    family = SERVED.get(architecture)
    if family is None or family != config.get("model_type"):
        raise ModelFilesError(f"'{config.get('model_type', '?')}' ({architecture or 'no architectures'}) is a page "
                              "retriever (a vector per image patch and per query token, scored by MaxSim) that is "
                              f"not served: {' and '.join(SERVED)} are; see docs/models.md")
    from transformers import AutoConfig  # published configs leave out the values that are its defaults

    read = AutoConfig.from_pretrained(model_dir)
    processor = _processor_files(model_dir)
    return (_read_colqwen2 if family == "colqwen2" else _read_colpali)(model_dir, read, processor)


def _read_colpali(model_dir: Path, read: Any, processor: dict[str, dict[str, Any]]) -> Pages:
    vision = read.vlm_config.vision_config
    image_tokens = processor["image"].get("image_seq_length")
    patches = (vision.image_size // vision.patch_size) ** 2
    if image_tokens != patches:
        raise ModelFilesError(f"{model_dir}: the image processor's image_seq_length is {image_tokens}, the vision "
                              f"tower computes {patches} patches ({vision.image_size} px in {vision.patch_size} px "
                              "patches): a page's image tokens would not match its patches")
    return Pages(read.architectures[0], "colpali", read.embedding_dim, image_tokens,
                 read.vlm_config.text_config.max_position_embeddings,
                 processor["processor"].get("visual_prompt_prefix", "Describe the image."),
                 processor["processor"].get("query_prefix", "Question: "))


def _read_colqwen2(model_dir: Path, read: Any, processor: dict[str, dict[str, Any]]) -> Pages:
    # Its pixel bound as transformers reads it: older folders write max_pixels.
    vision, image = read.vlm_config.vision_config, image_processor(model_dir)
    patch, merge = image.patch_size, image.merge_size
    if (patch, merge) != (vision.patch_size, vision.spatial_merge_size):
        raise ModelFilesError(f"{model_dir}: the image processor cuts {patch} px patches merged {merge} x {merge}, "
                              f"the vision tower takes {vision.patch_size} px merged {vision.spatial_merge_size} x "
                              f"{vision.spatial_merge_size}: a page's image tokens would not match its patches")
    most = image.size["longest_edge"]  # the pixels a page is resized within
    visual_prompt = processor["processor"].get("visual_prompt_prefix") or QWEN2_VL_PROMPT
    image_token = "<|image_pad|>"
    if visual_prompt.count(image_token) != 1:
        raise ModelFilesError(f"{model_dir}: the processor's visual_prompt_prefix holds {image_token} "
                              f"{visual_prompt.count(image_token)} times; a page's image tokens go where it is, once")
    return Pages(read.architectures[0], "colqwen2", read.embedding_dim, most // (patch * merge) ** 2,
                 read.vlm_config.text_config.max_position_embeddings, visual_prompt,
                 processor["processor"].get("query_prefix") or "Query: ", image_token, merge)


def _processor_files(model_dir: Path) -> dict[str, dict[str, Any]]:
    """The processor's settings and its image processor's, from either layout."""
    processor_file, image_file = model_dir / "processor_config.json", model_dir / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
    image = processor.get("image_processor") or (json.loads(image_file.read_text()) if image_file.is_file() else None)
    if not image:
        raise ModelFilesError(f"{model_dir} has no image processor settings (processor_config.json's "
                              "image_processor, or preprocessor_config.json)")
    return {"processor": processor, "image": image}


def prompt_bos(pages: Pages, tokenizer: Any) -> str:
    """The bos token a TextTokenizer's prompts hold: ColPali's processor writes it before a query
    and a page's visual prompt; ColQwen2's nothing (Qwen2's tokenizer has none)."""
    return tokenizer.token("bos") if pages.family == "colpali" else ""


def page_text(pages: Pages, bos: str, image_tokens: int) -> str:
    """A page image's text, its image token repeated `image_tokens` times."""
    if pages.family == "colqwen2":
        return pages.visual_prompt.replace(pages.image_token, pages.image_token * image_tokens)
    return f"{pages.image_token * image_tokens}{bos}{pages.visual_prompt}\n"


def query_text(pages: Pages, bos: str, pad: str, text: str) -> str:
    """What a query's ids are made of: the prefix, the text and the query augmentation."""
    return f"{bos}{pages.query_prefix}{text}{pad * QUERY_AUGMENTATION}\n"


def image_tokens(pages: Pages, grid: Sequence[int]) -> int:
    """The image tokens of a page whose patches are `grid` (temporal, rows, columns; () where
    every page has one size): the patches over those merged into a token."""
    return prod(grid) // pages.merge ** 2 if pages.merge else pages.image_tokens


@dataclass(frozen=True)
class PageIds:
    """A page's ids, the same for every page but for its image tokens' count: tokenized once."""
    before: tuple[int, ...]
    image: int  # the image token's id
    after: tuple[int, ...]

    @classmethod
    def of(cls, pages: Pages, tokenizer: Any) -> "PageIds":
        """From a TextTokenizer's ids of the page text with one image token."""
        [ids] = tokenizer.body_ids([page_text(pages, prompt_bos(pages, tokenizer), 1)])
        image = tokenizer.backend.token_to_id(pages.image_token)
        if image is None or ids.count(image) != 1:
            raise ModelFilesError(f"the tokenizer does not read {pages.image_token} as one token")
        at = ids.index(image)
        return cls(tuple(ids[:at]), image, tuple(ids[at + 1:]))

    def __call__(self, image_tokens: int) -> tuple[int, ...]:
        return self.before + (self.image,) * image_tokens + self.after


class PageEncoder:
    """(batch, seq) right-padded ids and attention mask, with the pixel values of a pass of page
    images -> (batch, seq, dimension) vectors, zero where the mask is. A pass is all page images or
    all queries: the image tokens of its rows take its pixels. ColPali's pixels are (batch,
    channels, height, width); ColQwen2's (batch, patches, values), right-padded, with each page's
    `grid` (batch, 3) of patches, as ColQwen2Processor hands them to the model."""

    engine = "torch"

    def __init__(self, model: torch.nn.Module, family: str = "colpali"):
        self.model = model
        self.family = family

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, pixels: torch.Tensor | None = None,
                 grid: torch.Tensor | None = None) -> torch.Tensor:
        if self.family == "colqwen2":
            return self.model(input_ids=ids, attention_mask=attention, pixel_values=pixels,
                              image_grid_thw=grid).embeddings
        # Token types all 0, as ColPaliProcessor gives them: PaliGemma attends over such a prefix both
        # ways; without them a query's positions would attend causally.
        return self.model(input_ids=ids, attention_mask=attention, pixel_values=pixels,
                          token_type_ids=torch.zeros_like(ids)).embeddings


def load_pages_model(model_dir: Path, architecture: str, *, device: torch.device, dtype: torch.dtype
                     ) -> torch.nn.Module:
    """transformers' ColPaliForRetrieval or ColQwen2ForRetrieval on `device` in `dtype`."""
    import transformers

    model = getattr(transformers, architecture)
    return model.from_pretrained(model_dir, dtype=dtype, use_safetensors=True).to(device).eval()


class PageQueries:
    """A padded backend's transformer for a page retriever's queries: (batch, seq) ids and mask ->
    (batch, seq, dimension) vectors (backends/padded.py hands them to MultiVectorPooler)."""

    attention = "transformers' own"

    def __init__(self, encoder: PageEncoder):
        self.encoder = encoder

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> torch.Tensor:
        return self.encoder(ids, attention)
