"""Tiny random image-text models made offline, for the image kind's tests.

A CLIP from openai/clip-vit-base-patch32's published files (tests/fixtures/published/
clip-vit-base-patch32/, sources in its SOURCES.json): its `config.json` with the towers shrunk
(hidden 32, 2 layers, a 16-wide shared space, the tiny vocabulary) and every other value as
published (quick_gelu, 77 text positions, 224-pixel images in 32-pixel patches, eos_token_id 2,
which makes the text tower pool at the highest token id, as the published model does), and its
`preprocessor_config.json` unchanged. Its tokenizer files were not found: the tiny WordPiece
vocabulary of tests/support/tiny_model.py stands in.

A SigLIP from transformers' SiglipConfig, whose defaults are google/siglip-base-patch16-224's
architecture (its published files were not found): 64 text positions, every text padded to them,
224-pixel images in 16-pixel patches, an attention-pooling head on the vision tower; the towers
shrunk as CLIP's, the image processor SiglipImageProcessor's defaults (224 x 224, no crop, mean and
std 0.5), the same tiny WordPiece vocabulary.

A SigLIP 2 NaFlex model (Siglip2Model) from transformers' Siglip2Config, whose defaults are
google/siglip2-base-patch16-naflex's architecture (its published files were not found): 64 text
positions, 16-pixel patches, a 16 x 16 position table resized to each image's grid, the towers
shrunk as CLIP's; its image processor Siglip2ImageProcessor's defaults (max_num_patches 256, the
published models' value, mean and std 0.5), or `max_num_patches` where a test sets another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import BertTokenizerFast, CLIPConfig, CLIPModel, Siglip2Config, Siglip2Model, SiglipConfig, \
    SiglipModel

from tests.support import REPO
from tests.support.tiny_model import _vocab

CLIP_PUBLISHED = REPO / "tests" / "fixtures" / "published" / "clip-vit-base-patch32"
TINY_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "projection_dim": 16}


def make_clip(path: Path, seed: int = 0, full_size: bool = False) -> Path:
    """A plain transformers CLIP folder (config, weights, tokenizer, image processor), as
    sentence-transformers loads one: texts through get_text_features, images through
    get_image_features, both into one 16-wide space. `full_size`: the published towers unshrunk
    (ViT-B/32, a 512-wide space), for benchmarks: the tiny vocabulary's ids are within its own."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(_vocab()) + "\n")
    BertTokenizerFast.from_pretrained(path, model_max_length=77).save_pretrained(path)
    config = json.loads((CLIP_PUBLISHED / "config.json").read_text())
    if not full_size:
        config["projection_dim"] = TINY_TOWER["projection_dim"]
        config["text_config"].update(TINY_TOWER, vocab_size=len(_vocab()))
        config["vision_config"].update(TINY_TOWER)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig.from_pretrained(path)).eval()
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))  # as published, not as re-saved
    shutil.copy(CLIP_PUBLISHED / "preprocessor_config.json", path / "preprocessor_config.json")
    return path


def make_siglip(path: Path, seed: int = 0) -> Path:
    """A plain transformers SiglipModel folder (config, weights, tokenizer, image processor) into
    one 32-wide space (the vision tower's width, which the text head projects to)."""
    from transformers import SiglipImageProcessor  # imported here: importing it warns where torchvision is absent
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(_vocab()) + "\n")
    BertTokenizerFast.from_pretrained(path, model_max_length=64).save_pretrained(path)
    tower = {key: value for key, value in TINY_TOWER.items() if key != "projection_dim"}
    ids = {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}  # the vocabulary's [PAD], [CLS], [SEP]
    config = SiglipConfig(text_config={**tower, **ids, "vocab_size": len(_vocab()), "max_position_embeddings": 64},
                          vision_config={**tower, "image_size": 224, "patch_size": 16})
    torch.manual_seed(seed)
    SiglipModel(config).eval().save_pretrained(path)
    SiglipImageProcessor().save_pretrained(path)
    return path


def make_siglip2(path: Path, seed: int = 0, max_num_patches: int = 256) -> Path:
    """A plain transformers Siglip2Model folder (SigLIP 2 NaFlex: an image keeps its aspect ratio)
    into one 32-wide space."""
    from transformers import Siglip2ImageProcessor  # imported here: importing it warns where torchvision is absent
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(_vocab()) + "\n")
    BertTokenizerFast.from_pretrained(path, model_max_length=64).save_pretrained(path)
    tower = {key: value for key, value in TINY_TOWER.items() if key != "projection_dim"}
    ids = {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    config = Siglip2Config(text_config={**tower, **ids, "vocab_size": len(_vocab()), "max_position_embeddings": 64},
                           vision_config=tower)
    torch.manual_seed(seed)
    Siglip2Model(config).eval().save_pretrained(path)
    Siglip2ImageProcessor(max_num_patches=max_num_patches).save_pretrained(path)
    return path
