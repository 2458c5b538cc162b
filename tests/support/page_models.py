"""Tiny random page retrievers made offline: transformers' ColPaliForRetrieval and
ColQwen2ForRetrieval.

vidore/colpali-v1.3-hf's published files were not found. The model is transformers'
ColPaliConfig (its defaults: PaliGemma's architecture, a Gemma language model and a SigLIP vision
tower) shrunk: hidden 32, 2 layers each, 56-pixel pages in 14-pixel patches (16 image tokens, as
the published 448 px in 14 px give 1024), 16-wide vectors (128 published). The processor is
ColPaliProcessor saved by transformers itself (the published prompts, "Describe the image." and
"Question: "; the image processor SiglipImageProcessor, bicubic, mean and std 0.5), over a word-
level tokenizer with Gemma's special tokens (<pad> 0, <eos> 1, <bos> 2, <unk> 3) and the words of
tests/support/tiny_model.py; the processor adds <image> and PaliGemma's location and segmentation
tokens, as it does to Gemma's.

vidore/colqwen2-v1.0-hf's published files were not found either. The ColQwen2 is transformers'
ColQwen2Config (Qwen2-VL's architecture) shrunk: hidden 32, 2 layers each, M-RoPE sections
[2, 1, 1] for 8-wide heads, 14-pixel patches merged 2 x 2 into an image token as published, pages
resized within 4 to 16 image tokens (28 x 28 pixels a token; Qwen2-VL's default bound is 1,280),
16-wide vectors. The processor is ColQwen2Processor saved by transformers itself (its published
prompts: the Qwen2-VL chat-formatted visual prompt and "Query: "; the image processor
Qwen2VLImageProcessor, CLIP's mean and std), over a word-level tokenizer with Qwen2's special
tokens (<|endoftext|> its pad, no bos) and the words of tests/support/tiny_model.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from tests.support.tiny_model import _vocab

IMAGE_SIZE, PATCH_SIZE = 56, 14
QWEN2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>"]
QWEN2_TOKEN_PIXELS = 28 * 28  # a 2 x 2 merge of 14-pixel patches


def shape(width: int, layers: int) -> dict[str, int]:
    """A transformer's shape: `width` wide in 4 heads or more, 64 wide from a width of 256; `layers` deep."""
    heads = max(4, width // 64)
    return {"hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": layers,
            "num_attention_heads": heads, "head_dim": width // heads}


def make_colpali(path: Path, seed: int = 0, image_size: int = IMAGE_SIZE, width: int = 32, layers: int = 2) -> Path:
    """`image_size` px pages in 14 px patches; `width` and `layers` each model's (bench/pages.py
    takes larger ones)."""
    from transformers import (ColPaliConfig, ColPaliForRetrieval, ColPaliProcessor, PreTrainedTokenizerFast,
                              SiglipImageProcessor)

    path.mkdir(parents=True, exist_ok=True)
    words = ["<pad>", "<eos>", "<bos>", "<unk>", *(w for w in _vocab() if not w.startswith("[")), "\n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|[^\s]+"), behavior="removed", invert=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")
    images = SiglipImageProcessor(size={"height": image_size, "width": image_size}, resample=3)
    images.image_seq_length = (image_size // PATCH_SIZE) ** 2
    processor = ColPaliProcessor(image_processor=images, tokenizer=tokenizer)  # adds <image> and the extra tokens
    processor.save_pretrained(path)
    vocabulary = len(tokenizer)
    config = ColPaliConfig(embedding_dim=16, vlm_config={
        "model_type": "paligemma", "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
        "vocab_size": vocabulary, "hidden_size": width, "projection_dim": width,
        "text_config": {**shape(width, layers), "num_key_value_heads": 1, "vocab_size": vocabulary},
        "vision_config": {**shape(width, layers), "image_size": image_size, "patch_size": PATCH_SIZE,
                          "projection_dim": width, "num_image_tokens": images.image_seq_length}})
    torch.manual_seed(seed)
    ColPaliForRetrieval(config).eval().save_pretrained(path)
    return path


def make_colqwen2(path: Path, seed: int = 0, most_tokens: int = 16, width: int = 32, layers: int = 2) -> Path:
    """A page retriever whose pages keep their size: `most_tokens` image tokens a page at the
    processor's pixel bound; `width` and `layers` each model's (bench/pages.py takes larger ones)."""
    from transformers import (ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor, PreTrainedTokenizerFast,
                              Qwen2VLImageProcessor)

    path.mkdir(parents=True, exist_ok=True)
    words = [*QWEN2_SPECIAL, *(w for w in _vocab() if not w.startswith("[")), "\n", "user", "Describe", "image.",
             "Query:"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|[^\s]+"), behavior="removed", invert=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        unk_token="<|endoftext|>", additional_special_tokens=QWEN2_SPECIAL[1:])
    images = Qwen2VLImageProcessor(min_pixels=4 * QWEN2_TOKEN_PIXELS, max_pixels=most_tokens * QWEN2_TOKEN_PIXELS,
                                   patch_size=14, merge_size=2, temporal_patch_size=2)
    ColQwen2Processor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)
    token = tokenizer.convert_tokens_to_ids
    vocabulary = len(tokenizer)
    text = shape(width, layers)
    rotary = text.pop("head_dim") // 2  # Qwen2-VL's heads are hidden / heads wide
    config = ColQwen2Config(embedding_dim=16, vlm_config={
        "model_type": "qwen2_vl", "vocab_size": vocabulary, "image_token_id": token("<|image_pad|>"),
        "video_token_id": token("<|video_pad|>"), "vision_start_token_id": token("<|vision_start|>"),
        "text_config": {**text, "model_type": "qwen2_vl_text", "num_key_value_heads": 2, "vocab_size": vocabulary,
                        "bos_token_id": None, "eos_token_id": token("<|endoftext|>"),
                        # M-RoPE: half a head's rotary pairs on time, a quarter each on rows and columns
                        "rope_scaling": {"type": "mrope", "mrope_section": [rotary // 2, rotary // 4, rotary // 4]}},
        "vision_config": {"depth": layers, "embed_dim": width, "hidden_size": width,
                          "num_heads": text["num_attention_heads"], "mlp_ratio": 2, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2}})
    torch.manual_seed(seed)
    ColQwen2ForRetrieval(config).eval().save_pretrained(path)
    return path
