"""Image-text dual encoders (CLIP, SigLIP, SigLIP 2): a text tower and a vision tower, each pooled
its own way into one shared space, so that a text and an image are compared by their vectors.

What the folder says (`read_towers`): transformers' CLIPModel, SiglipModel (SigLIP, and SigLIP 2's
fixed-resolution models) or Siglip2Model (SigLIP 2's variable-resolution models), as transformers
saves it or as sentence-transformers 5.4+ saves it (one multimodal Transformer module in the
folder itself, whose `encode` runs `get_text_features` on texts and `get_image_features` on
images). How each tower runs (`TextTower`, `ImageTower`): transformers' own `get_text_features`
and `get_image_features`, so the vectors are the reference's by construction.

SigLIP's text tower pools the last position of a sequence padded to a fixed length (64 tokens,
its position table): it was trained so, and its model card tokenizes with padding="max_length".
A text's vector therefore depends on that padding, and the tower pads every pass to the full
length itself (`TextFeed`), whatever the planner cut, on the side the folder's tokenizer pads:
the right for SigLIP's, the left for SigLIP 2's Gemma tokenizers as transformers loads them
(its Siglip2Tokenizer, which also lowercases: the served tokenizer is the one it loads).
sentence-transformers pads a batch to its longest text unless the folder's `processing_kwargs`
say otherwise, so its `encode` of a SigLIP text depends on the other texts of its batch; the
vectors here are the model card's.

SigLIP 2's variable-resolution (NaFlex) models keep an image's aspect ratio: the image processor
resizes it to a grid of patches of about its own shape within `max_num_patches` and pads its
patches to that count, so images of any shape still stack into one pass; the tower is fed each
image's grid (`spatial_shapes`), from which the mask of its real patches follows, and resizes its
position table to that grid. An image costs the planner `max_num_patches` positions, what it is
padded to.

Refused, saying why: sentence-transformers' older layout with the model in a `0_CLIPModel`
subfolder (build that subfolder itself: it is a plain CLIP folder).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embedserve.handler.model.description import ModelFilesError, Towers
from embedserve.handler.model.image_processor import image_processor

SERVED = {"CLIPModel": "clip", "SiglipModel": "siglip", "Siglip2Model": "siglip2"}


def read_towers(model_dir: Path, config: dict[str, Any]) -> Towers:
    """A dual encoder's facts, or the reason it is not served."""
    model_type = config.get("model_type", "?")
    architecture = str((config.get("architectures") or [""])[0])
    if architecture not in SERVED or SERVED[architecture] != model_type:
        raise ModelFilesError(f"'{model_type}' ({architecture or 'no architectures'}) is an image-text model that is "
                              f"not served: {', '.join(SERVED)} are; see docs/models.md")
    _check_modules(model_dir)
    # transformers' reading of the config: published configs leave out the values that are its defaults.
    from transformers import AutoConfig

    read = AutoConfig.from_pretrained(model_dir)
    text, vision = read.text_config, read.vision_config
    if model_type == "siglip2":
        patches = _naflex_patches(model_dir, vision.patch_size)
    else:
        patches = (vision.image_size // vision.patch_size) ** 2
    if model_type == "clip":
        return Towers(architecture, read.projection_dim, text.max_position_embeddings, patches)
    if text.projection_size != vision.hidden_size:
        raise ModelFilesError(f"{model_dir / 'config.json'}: the text tower projects to {text.projection_size} "
                              f"dimensions, the vision tower's pooling gives {vision.hidden_size}: not one space")
    return Towers(architecture, vision.hidden_size, text.max_position_embeddings, patches,
                  text_length=text.max_position_embeddings, own_grid=model_type == "siglip2")


def _naflex_patches(model_dir: Path, patch_size: int) -> int:
    """The patches a NaFlex image is padded to, as the folder's image processor reads its
    preprocessor_config.json (its own default where the file leaves it out)."""
    try:
        processor = image_processor(model_dir)
    except (OSError, ValueError) as err:
        raise ModelFilesError(f"{model_dir}: SigLIP 2's image processor does not load ({err})") from None
    processor_patch = getattr(processor, "patch_size", None)
    if processor_patch != patch_size:
        raise ModelFilesError(f"{model_dir / 'preprocessor_config.json'}: the image processor cuts {processor_patch}-"
                              f"pixel patches, the vision tower takes {patch_size}-pixel ones")
    return int(processor.max_num_patches)


def _check_modules(model_dir: Path) -> None:
    """No sentence-transformers files, or one module, the model itself in the folder."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return
    modules = json.loads(modules_file.read_text())
    kinds = [(str(module.get("type", "")).rsplit(".", 1)[-1], str(module.get("path") or "")) for module in modules]
    if len(kinds) == 1 and kinds[0][0] in ("Transformer", "CLIPModel") and not kinds[0][1]:
        return
    if len(kinds) == 1 and kinds[0][0] == "CLIPModel":
        raise ModelFilesError(f"{modules_file}: the CLIP model is in the subfolder '{kinds[0][1]}' (sentence-"
                              f"transformers' older layout); build that subfolder itself, a plain CLIP folder")
    raise ModelFilesError(f"{modules_file}: an image-text model with modules {[kind for kind, _ in kinds]}; served: "
                          "the model alone (one Transformer or CLIPModel module in the folder itself)")


def _features(out: Any) -> torch.Tensor:
    """transformers 5 returns the projected features as an output's pooler_output, 4.x as a tensor."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@dataclass(frozen=True)
class TextFeed:
    """What a text tower is fed: right-padded (batch, seq) ids and mask, re-padded with `pad_id` to
    `length` (SigLIP's fixed length; None for CLIP's, which reads the end-of-text token wherever it
    is), on the left where `left` (the folder's tokenizer pads there), and the mask passed on where
    `masked` (the folder's tokenizer returns one; transformers' SigLIP tokenizers did not before
    5.0: the padding was attended to). The same for either engine."""
    length: int | None = None
    pad_id: int = 0
    masked: bool = True
    left: bool = False

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.length is not None:
            ids, attention = padded_to(self.length, ids, attention, self.pad_id, left=self.left)
        return ids, attention if self.masked else None

    def graph_inputs(self, ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tower's export's inputs: a model given no mask attends to every position, as an
        all-ones mask has it."""
        ids, mask = self(ids, attention)
        return ids, torch.ones_like(ids) if mask is None else mask


class TextTower:
    """(batch, seq) right-padded ids and attention mask -> (batch, dimension) projected text features.
    (On a CPU in float32, its ONNX export runs instead where the build made one: OnnxTextTower.)"""

    def __init__(self, model: torch.nn.Module, feed: TextFeed = TextFeed()):
        self.model = model
        config = getattr(model, "_orig_mod", model).config
        self.attention = getattr(config, "_attn_implementation", None) or "eager"
        self.feed = feed

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> torch.Tensor:
        ids, mask = self.feed(ids, attention)
        return _features(self.model.get_text_features(input_ids=ids, attention_mask=mask))


def padded_to(length: int, ids: torch.Tensor, attention: torch.Tensor, pad_id: int, left: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (batch, seq) ids and mask, re-padded with `pad_id` to exactly `length`
    positions (no text is longer: the tokenizer truncates to the position table); on the left
    where `left`: each row's tokens then end at the last position."""
    rows, seq = ids.shape
    if left:  # position p holds the row's token p - (length - its count), padding where that is < 0
        source = torch.arange(length, device=ids.device)[None, :] - (length - attention.sum(dim=1))[:, None]
        real = source >= 0
        return ids.gather(1, source.clamp(0, seq - 1)).masked_fill(~real, pad_id), real.to(attention.dtype)
    if seq > length:  # a pass padded past the table (a pad multiple): only padding lies beyond it
        return ids[:, :length].masked_fill(attention[:, :length] == 0, pad_id), attention[:, :length]
    full = ids.new_full((rows, length), pad_id)
    full[:, :seq] = ids.masked_fill(attention == 0, pad_id)
    mask = attention.new_zeros((rows, length))
    mask[:, :seq] = attention
    return full, mask


class ImageTower:
    """(batch, channels, height, width) pixel values -> (batch, dimension) projected image features;
    for a NaFlex tower, (batch, patches, values) pixel values of patches padded to one count and each
    image's (rows, columns) grid of real patches. (On a CPU in float32, a fixed-size tower's ONNX
    export runs instead where the build made one: OnnxImageTower.)"""

    engine = "torch"

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, pixels: torch.Tensor, grids: torch.Tensor | None = None) -> torch.Tensor:
        if grids is None:
            return _features(self.model.get_image_features(pixel_values=pixels))
        # An image's real patches come first, its padding after: the processor's own mask.
        real = torch.arange(pixels.shape[1], device=pixels.device)[None, :] < grids.prod(dim=1)[:, None]
        return _features(self.model.get_image_features(pixel_values=pixels, pixel_attention_mask=real.to(torch.int32),
                                                       spatial_shapes=grids))
