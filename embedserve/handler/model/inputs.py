"""One input of a forward pass, as every layer below the tasks sees it.

A task (embedserve/handler/tasks/) turns each input of a request into a ModelInput; the planner,
the cache keys, the encoder and the backends carry these records, never parallel lists. A new
per-input fact a task needs (a span to pool, a segment) is one more field here, read by the
backends that use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Iterable, Sequence


class TokenRole(IntEnum):
    """What a position of a right-padded pass is, in its pooling mask (model/pooling.py)."""
    PAD = 0  # padding: neither attended to nor pooled
    POOLED = 1  # a token the model attends to and pooling uses
    # A token the model attends to but pooling leaves out: an excluded prompt (include_prompt:
    # false), or, late chunking, a token outside the span pooled.
    PROMPT = 2
    SECOND = 3  # a token of a pair's second text (token type 1), for scoring models, which do not pool
    # A query expansion token (ColBERT's [MASK] padding) the model computes and returns but no token
    # attends to: negative, so that the attention mask (the roles clamped to 0..1) leaves it out.
    EXPANSION = -1


@dataclass(frozen=True)
class ModelInput:
    ids: Sequence[int]  # the model's input ids, special tokens included
    unpooled: int = 0  # leading tokens pooling leaves out (an excluded prompt)
    second: int = 0  # where a pair's second text starts (token type 1); 0: a single text
    expansion: int = 0  # trailing query expansion tokens no token attends to (TokenRole.EXPANSION)
    # Where pooling stops (late chunking pools one span, `unpooled` up to here, of an input every
    # token of which is attended to); 0: the input's end.
    pooled_end: int = 0
    # An image's pixel values (channels, height, width) for an image-text model's vision tower
    # (inputs/image.py), `ids` then empty; `positions`: the patches the tower computes, its length.
    image: Any = None
    positions: int = 0
    # An image that keeps its own shape, its grid of patches: a ColQwen2 page's (temporal, rows,
    # columns), a SigLIP 2 NaFlex image's (rows, columns); its pixel values then (patches, values).
    # () for an image resized to the processor's one size.
    grid: tuple[int, ...] = ()

    def __len__(self) -> int:
        """The positions the model computes for this input: what the planner prices a pass by."""
        return len(self.ids) if self.image is None else self.positions


def plain_inputs(token_ids: Iterable[Sequence[int]]) -> list[ModelInput]:
    """Inputs that are token ids alone: every token pooled, one segment."""
    return [ModelInput(ids) for ids in token_ids]


def distinct_tokens(inputs: Sequence[ModelInput]) -> int:
    """The tokens inputs cost where rows of the same ids share one pass (late chunking's spans of
    one window, backends/padded.py): each distinct row once."""
    if not any(item.pooled_end for item in inputs):
        return sum(map(len, inputs))
    return sum(len(ids) for ids in {tuple(item.ids) for item in inputs})
