"""Tiny random image-text models made offline, for the image kind's tests: a CLIP of the published
shape (two towers, projections to a shared space) with the tiny WordPiece vocabulary of
tests/support/tiny_model.py, and openai/clip-vit-base-patch32's image processor settings (its
published preprocessor_config.json: shortest edge 224, bicubic, centre crop 224, CLIP's mean and
std)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertTokenizerFast, CLIPConfig, CLIPImageProcessor, CLIPModel

from tests.support.tiny_model import _vocab

CLIP_PREPROCESSOR = {
    "crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3, "size": 224,
}


def make_clip(path: Path, seed: int = 0) -> Path:
    """A plain transformers CLIP folder (config, weights, tokenizer, image processor), as
    sentence-transformers loads one: texts through get_text_features, images through
    get_image_features, both into one 16-wide space."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(_vocab()) + "\n")
    BertTokenizerFast.from_pretrained(path, model_max_length=64).save_pretrained(path)
    torch.manual_seed(seed)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    # The text tower pools at its end-of-text token: the tokenizer's [SEP] (id 3).
    config = CLIPConfig(text_config=dict(tower, vocab_size=len(_vocab()), max_position_embeddings=64, pad_token_id=0,
                                         bos_token_id=2, eos_token_id=3),
                        vision_config=dict(tower, image_size=224, patch_size=32), projection_dim=16)
    CLIPModel(config).eval().save_pretrained(path)
    CLIPImageProcessor(**CLIP_PREPROCESSOR).save_pretrained(path)
    return path
