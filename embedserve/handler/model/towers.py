"""Image-text dual encoders (CLIP): a text tower and a vision tower, each pooled its own way and
projected into one shared space, so that a text and an image are compared by their vectors.

What the folder says (`read_towers`): transformers' CLIPModel, as transformers saves it or as
sentence-transformers 5.4+ saves it (one multimodal Transformer module in the folder itself,
whose `encode` runs `get_text_features` on texts and `get_image_features` on images). How each
tower runs (`TextTower`, `ImageTower`): transformers' own `get_text_features` (the end-of-text
token's state through the text projection) and `get_image_features` (the class token's through
the visual projection), so the vectors are the reference's by construction.

Refused, saying why: SigLIP (its text tower reads the last of a fixed 64-token padding, which the
padded passes here do not reproduce), ColPali-style page retrievers, and sentence-transformers'
older layout with the model in a `0_CLIPModel` subfolder (build that subfolder itself: it is a
plain CLIP folder).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from embedserve.handler.model.description import ModelFilesError, Towers

SERVED = {"CLIPModel": "clip"}


def read_towers(model_dir: Path, config: dict[str, Any]) -> Towers:
    """A dual encoder's facts, or the reason it is not served."""
    model_type = config.get("model_type", "?")
    architecture = str((config.get("architectures") or [""])[0])
    if architecture not in SERVED or SERVED[architecture] != model_type:
        why = ("its text tower reads the last position of a fixed 64-token padding, which these padded passes do "
               "not reproduce" if model_type.startswith("siglip") else "only CLIPModel is served")
        raise ModelFilesError(f"'{model_type}' ({architecture or 'no architectures'}) is an image-text model that is "
                              f"not served: {why}; see docs/models.md")
    _check_modules(model_dir)
    text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
    try:
        patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
        return Towers(architecture, int(config["projection_dim"]), int(text["max_position_embeddings"]), patches)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelFilesError(f"{model_dir / 'config.json'}: a CLIP config needs projection_dim, "
                              f"text_config.max_position_embeddings and vision_config's image_size and patch_size "
                              f"({type(err).__name__}: {err})") from None


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


class TextTower:
    """(batch, seq) ids and attention mask -> (batch, dimension) projected text features."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        config = getattr(model, "_orig_mod", model).config
        self.attention = getattr(config, "_attn_implementation", None) or "eager"

    def __call__(self, ids: torch.Tensor, attention: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> torch.Tensor:
        return _features(self.model.get_text_features(input_ids=ids, attention_mask=attention))


class ImageTower:
    """(batch, channels, height, width) pixel values -> (batch, dimension) projected image features."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        return _features(self.model.get_image_features(pixel_values=pixels))
