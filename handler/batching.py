"""Batch planning: flatten requests into one item list, cut it into forward passes, split back.

Items are sorted by token length before cutting, so each forward pass pads to a length close
to its members' own, and cut under a budget of padded tokens (longest x count), so a request
of thousands of texts is simply more forward passes.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def flatten(groups: Sequence[Sequence[T]]) -> tuple[list[T], list[slice]]:
    """Concatenate the groups; slice i selects group i's items in the flat list."""
    items: list[T] = []
    spans: list[slice] = []
    for group in groups:
        start = len(items)
        items.extend(group)
        spans.append(slice(start, len(items)))
    return items, spans


def padded_length(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def plan_sub_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int,
                     pad_multiple: int = 1) -> list[list[int]]:
    """Group item indices into forward passes, longest first.

    A pass holds at most `max_batch_size` items and at most `max_batch_tokens` padded tokens
    (its longest item's length, rounded up to `pad_multiple`, times its count); an item longer
    than the budget runs alone. Every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        # Sorted descending, so the first item of a pass is its longest.
        longest = padded_length(lengths[current[0]] if current else lengths[index], pad_multiple)
        if current and (len(current) >= max_batch_size or longest * (len(current) + 1) > max_batch_tokens):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches
