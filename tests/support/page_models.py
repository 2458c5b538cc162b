"""A tiny random page retriever made offline: transformers' ColPaliForRetrieval.

vidore/colpali-v1.3-hf's published files were not found. The model is transformers'
ColPaliConfig (its defaults: PaliGemma's architecture, a Gemma language model and a SigLIP vision
tower) shrunk: hidden 32, 2 layers each, 56-pixel pages in 14-pixel patches (16 image tokens, as
the published 448 px in 14 px give 1024), 16-wide vectors (128 published). The processor is
ColPaliProcessor saved by transformers itself (the published prompts, "Describe the image." and
"Question: "; the image processor SiglipImageProcessor, bicubic, mean and std 0.5), over a word-
level tokenizer with Gemma's special tokens (<pad> 0, <eos> 1, <bos> 2, <unk> 3) and the words of
tests/support/tiny_model.py; the processor adds <image> and PaliGemma's location and segmentation
tokens, as it does to Gemma's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from tests.support.tiny_model import _vocab

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
IMAGE_SIZE, PATCH_SIZE = 56, 14


def make_colpali(path: Path, seed: int = 0) -> Path:
    from transformers import (ColPaliConfig, ColPaliForRetrieval, ColPaliProcessor, PreTrainedTokenizerFast,
                              SiglipImageProcessor)

    path.mkdir(parents=True, exist_ok=True)
    words = ["<pad>", "<eos>", "<bos>", "<unk>", *(w for w in _vocab() if not w.startswith("[")), "\n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|[^\s]+"), behavior="removed", invert=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")
    images = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, resample=3)
    images.image_seq_length = (IMAGE_SIZE // PATCH_SIZE) ** 2
    processor = ColPaliProcessor(image_processor=images, tokenizer=tokenizer)  # adds <image> and the extra tokens
    processor.save_pretrained(path)
    vocabulary = len(tokenizer)
    config = ColPaliConfig(embedding_dim=16, vlm_config={
        "model_type": "paligemma", "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
        "vocab_size": vocabulary, "hidden_size": 32, "projection_dim": 32,
        "text_config": {**TINY, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": vocabulary},
        "vision_config": {**TINY, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "projection_dim": 32,
                          "num_image_tokens": images.image_seq_length}})
    torch.manual_seed(seed)
    ColPaliForRetrieval(config).eval().save_pretrained(path)
    return path
