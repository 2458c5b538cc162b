"""Inputs longer than the model, cut into windows and combined ("long_input": "chunk"), and
late chunking ("long_input": "late_chunk").

An input's tokens (its prompt first, kept whole in every window) are cut into windows of the
model's length, `overlap` tokens of text repeated from one window to the next; each window is
wrapped in the special tokens the tokenizer adds to any text and goes through the model's whole
pipeline as a text of its own would (a model input like any other: batched with the other
requests' inputs, counted in the work bound, cached). The input's vector is the mean of its
windows' vectors weighted by the text tokens each holds, before the answer's own normalization
(the pipeline's final Normalize, model/head.py), so it is the pipeline's on each window, then
combined, then normalized. An input that fits is one window: the same vector as truncation gives.

Late chunking pools spans of one pass instead of embedding them apart: each span's tokens are
pooled from the token states of the whole input (every token attends to every other), so a span
keeps its context ("it" knows what it refers to). Spans are fixed-size runs of `chunk_size` text
tokens, or the caller's character ranges (`chunk_spans`). An input that fits the model is one pass;
a longer one is cut into windows of the model's length, each holding whole spans and, before its
first, up to `chunk_overlap` tokens of the text before them as context. Each span is one model
input: its window's ids, pooled from its first token to its last (ModelInput.unpooled and
pooled_end); the spans of one window share one forward pass (backends/padded.py, packed.py). The vector is
the pipeline's after pooling (its Dense layers), then the answer's normalization. It needs
pooling over tokens (mean, max): a CLS or last-token vector has no span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from embedserve.handler.api.errors import unprocessable
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.tokenization import TextTokenizer

# Pooling that has a vector for any run of tokens: what late chunking can pool a span with.
SPAN_POOLING = ("mean", "max", "mean_sqrt_len_tokens")


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


@dataclass(frozen=True)
class Span:
    """One late chunk of an input: its text tokens [start, end), and its characters where the input
    was a text (None for token ids)."""
    tokens: tuple[int, int]
    chars: tuple[int, int] | None


def fixed_spans(length: int, size: int) -> list[tuple[int, int]]:
    """Runs of `size` text tokens, the last one shorter; one empty span for an empty text."""
    return [(start, min(start + size, length)) for start in range(0, length, size)] or [(0, 0)]


def char_spans(ranges: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]], param: str
               ) -> list[tuple[int, int]]:
    """Each character range [start, end) as the text tokens whose characters it overlaps: from the
    first token ending after `start` to the last starting before `end` (binary searches, so that
    many ranges over a long text cost little)."""
    places = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    ends = np.maximum.accumulate(places[:, 1]) if len(places) else places[:, 1]  # non-decreasing
    starts = np.minimum.accumulate(places[::-1, 0])[::-1] if len(places) else places[:, 0]
    spans = []
    for j, (start, end) in enumerate(ranges):
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(starts, end, side="left"))  # one past the last token starting before `end`
        if first >= last:
            raise unprocessable(f"'{param}[{j}]' [{start}, {end}) holds no token of the text", param=f"{param}[{j}]")
        spans.append((first, last))
    return spans


def late_chunk(tokenizer: TextTokenizer, body: Sequence[int], spans: Sequence[tuple[int, int]], max_length: int,
               prompt_tokens: int, context: int, param: str, unpooled_prompt: int = 0) -> list[ModelInput]:
    """One model input per span of `body` (token ids without special tokens, the prompt's first):
    the window holding it, pooled over it alone. Windows start at the text's start and move on
    when a span does not fit, carrying up to `context` tokens before it. An empty text's one span
    (0, 0) is its window pooled as a plain input is (`unpooled_prompt` left out)."""
    room = text_room(tokenizer, max_length, prompt_tokens)
    prompt, text = list(body[:prompt_tokens]), list(body[prompt_tokens:])
    lead = len(tokenizer.prefix) + prompt_tokens  # window positions before its text
    start, ids = 0, None
    inputs = []
    for j, (first, last) in enumerate(spans):
        if last - first > room:
            raise unprocessable(f"'{param}[{j}]' spans {last - first} tokens; a span must fit one window of "
                                f"{room} tokens of text (the max input length {max_length} less the special tokens "
                                "and the prompt)", param=f"{param}[{j}]")
        if ids is None or first < start or last > start + room:  # a new window: the span with context before it
            start = max(0, min(first - context, len(text) - room), last - room)
            ids = tokenizer.prefix + prompt + text[start:start + room] + tokenizer.suffix  # shared by its spans
        inputs.append(ModelInput(ids, unpooled=lead + first - start, pooled_end=lead + last - start)
                      if last > first else ModelInput(ids, unpooled=unpooled_prompt))
    return inputs
