"""Inputs longer than the model, cut into windows and combined ("long_input": "chunk").

An input's tokens (its prompt first, kept whole in every window) are cut into windows of the
model's length, `overlap` tokens of text repeated from one window to the next; each window is
wrapped in the special tokens the tokenizer adds to any text and goes through the model's whole
pipeline as a text of its own would (a model input like any other: batched with the other
requests' inputs, counted in the work bound, cached). The input's vector is the mean of its
windows' vectors weighted by the text tokens each holds, before the answer's own normalization
(the pipeline's final Normalize, model/head.py), so it is the pipeline's on each window, then
combined, then normalized. An input that fits is one window: the same vector as truncation gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from embedserve.handler.api.errors import unprocessable
from embedserve.handler.model.tokenization import TextTokenizer


@dataclass(frozen=True)
class Chunked:
    ids: list[list[int]]  # each window's model input ids, the windows of input 0 first
    windows: tuple[int, ...]  # windows per input
    weights: tuple[int, ...]  # each window's text tokens: its weight in its input's vector


def text_room(tokenizer: TextTokenizer, max_length: int, prompt_tokens: int) -> int:
    """Tokens of text a window holds: the model's length less the special tokens and the prompt."""
    return max_length - len(tokenizer.prefix) - len(tokenizer.suffix) - prompt_tokens


def max_overlap(tokenizer: TextTokenizer, max_length: int, longest_prompt_tokens: int) -> int:
    """The largest overlap every prompt of the model leaves room for: one below the text a window
    holds beside the longest prompt. A bound of the model, not of the request, so the OpenAPI
    document states it and a request within it is never refused for it."""
    return max(0, text_room(tokenizer, max_length, longest_prompt_tokens) - 1)


def check_room(tokenizer: TextTokenizer, max_length: int, prompt_tokens: int) -> None:
    if text_room(tokenizer, max_length, prompt_tokens) < 1:
        raise unprocessable(f"the prompt's {prompt_tokens} tokens leave no room for text in a window of "
                            f"{max_length} tokens", param="long_input")


def check_overlap(overlap: int, limit: int, max_length: int) -> None:
    """Checked on every request, chunked or not, as every option is: its bound is the document's."""
    if overlap > limit:
        raise unprocessable(f"'chunk_overlap' must be at most {limit}, one below the tokens of text a window holds "
                            f"beside the model's longest prompt (the max input length {max_length} less the special "
                            f"tokens and the prompt), got {overlap}", param="chunk_overlap")


def chunk_inputs(tokenizer: TextTokenizer, bodies: Sequence[Sequence[int]], max_length: int, prompt_tokens: int,
                 overlap: int) -> Chunked:
    """The windows of each body (token ids without special tokens, the prompt's first)."""
    room = text_room(tokenizer, max_length, prompt_tokens)
    step = room - overlap
    ids: list[list[int]] = []
    windows: list[int] = []
    weights: list[int] = []
    for body in bodies:
        prompt, text = list(body[:prompt_tokens]), list(body[prompt_tokens:])
        starts = range(0, len(text) - overlap, step) if len(text) > room else range(1)
        for start in starts:
            window = text[start:start + room]
            ids.append(tokenizer.prefix + prompt + window + tokenizer.suffix)
            weights.append(len(window) if len(starts) > 1 else 1)
        windows.append(len(starts))
    return Chunked(ids, tuple(windows), tuple(weights))


def pool_windows(vectors: torch.Tensor, windows: Sequence[int], weights: Sequence[int]) -> torch.Tensor:
    """(windows in all, dimension) -> (inputs, dimension): each input's windows' weighted mean."""
    weight = torch.tensor(weights, dtype=vectors.dtype)
    owner = torch.repeat_interleave(torch.arange(len(windows)), torch.tensor(windows))
    sums = torch.zeros(len(windows), vectors.shape[1], dtype=vectors.dtype).index_add_(0, owner,
                                                                                     vectors * weight[:, None])
    totals = torch.zeros(len(windows), dtype=vectors.dtype).index_add_(0, owner, weight)
    return sums / totals[:, None]
