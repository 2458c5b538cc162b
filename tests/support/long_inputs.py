"""The reference for "long_input": "chunk", computed independently of the server's code:
sentence-transformers' own tokenizer cuts the text into windows of the model's length (the prompt
and [CLS] ... [SEP] in each), its pipeline (its forward on each window's ids) embeds them, and
their mean weighted by each window's text tokens is normalized here."""

from __future__ import annotations

import numpy as np
import torch

from tests.support.inputs import varied_texts

LONG = " ".join(varied_texts(60, seed=3))  # hundreds of tokens: many windows of the tiny model's 48


def reference(st_model, text: str, max_length: int, overlap: int = 0, prompt: str = "") -> tuple[np.ndarray, int]:
    """The chunked vector as sentence-transformers' pipeline gives it window by window, and the windows."""
    tokenizer = st_model.tokenizer
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    ids = tokenizer(prompt + text, add_special_tokens=False)["input_ids"][len(prompt_ids):]
    room = max_length - 2 - len(prompt_ids)  # [CLS] ... [SEP]
    starts = list(range(0, len(ids) - overlap, room - overlap)) if len(ids) > room else [0]
    vectors, weights = [], []
    for start in starts:
        window = [tokenizer.cls_token_id, *prompt_ids, *ids[start:start + room], tokenizer.sep_token_id]
        features = {"input_ids": torch.tensor([window]), "attention_mask": torch.ones(1, len(window), dtype=torch.long)}
        with torch.inference_mode():
            vectors.append(st_model(features)["sentence_embedding"][0].double().numpy())
        weights.append(len(ids[start:start + room]))
    mean = np.average(np.stack(vectors), axis=0, weights=weights)
    return mean / np.linalg.norm(mean), len(starts)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

