"""The reference for "long_input": "chunk", computed independently of the server's code:
sentence-transformers' own tokenizer cuts the text into windows of the model's length (the prompt
and [CLS] ... [SEP] in each), its pipeline (its forward on each window's ids) embeds them, and
their mean weighted by each window's text tokens is normalized here."""

from __future__ import annotations

import json

import numpy as np
import torch

from embedserve.handler.api.exchange import RawRequest
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


def call(service, route: str, body: dict) -> tuple[int, dict]:
    """One JSON request through an in-process service: its status and its answer."""
    [response] = service.handle([RawRequest(json.dumps(body).encode(), "application/json", route)])
    return response.status, json.loads(response.body)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))



def late_reference(st_model, text: str, max_length: int, spans: list[tuple[int, int]] | None = None,
                   size: int = 256, context: int = 0, prompt: str = "") -> list[tuple[np.ndarray, tuple, tuple]]:
    """Late chunking as sentence-transformers' token vectors give it: for each span (fixed runs of
    `size` text tokens, or the tokens the character ranges `spans` touch), the mean of its tokens'
    vectors (output_value="token_embeddings") over the input's one pass, or, for an input longer than
    the model, over the window holding the span (windows of the model's length, moving on when a span
    does not fit, `context` tokens before it); then the pipeline after Pooling, normalized. Each
    span's vector, tokens and characters."""
    tokenizer = st_model.tokenizer
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    encoded = tokenizer(prompt + text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"][len(prompt_ids):], encoded["offset_mapping"][len(prompt_ids):]
    offsets = [(a - len(prompt), b - len(prompt)) for a, b in offsets]
    if spans is None:
        token_spans = [(s, min(s + size, len(ids))) for s in range(0, len(ids), size)]
    else:
        token_spans = []
        for start, end in spans:
            hit = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
            token_spans.append((hit[0], hit[-1] + 1))
    room = max_length - 2 - len(prompt_ids)
    after_pooling = [module for module in list(st_model)[2:]]
    results, window = [], None
    for first, last in token_spans:
        if window is None or first < window[0] or last > window[0] + room:
            start = max(0, min(first - context, len(ids) - room), last - room)
            window_ids = [tokenizer.cls_token_id, *prompt_ids, *ids[start:start + room], tokenizer.sep_token_id]
            if start == 0 and len(ids) <= room:  # the whole input: encode's own token vectors
                states = st_model.encode(prompt + text, output_value="token_embeddings", convert_to_tensor=True)
            else:
                features = {"input_ids": torch.tensor([window_ids]),
                            "attention_mask": torch.ones(1, len(window_ids), dtype=torch.long)}
                with torch.inference_mode():
                    states = st_model[0](features)["token_embeddings"][0]
            window = (start, states.double())
        lead = 1 + len(prompt_ids) - window[0]
        vector = window[1][lead + first:lead + last].mean(dim=0).float()
        features = {"sentence_embedding": vector[None]}
        with torch.inference_mode():
            for module in after_pooling:
                features = module(features)
        out = features["sentence_embedding"][0].double().numpy()
        results.append((out / np.linalg.norm(out), (first, last), (offsets[first][0], offsets[last - 1][1])))
    return results
