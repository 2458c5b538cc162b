"""Batch planning: flatten requests into one item list, cut it into forward passes, split back.

Items are sorted by token length before cutting, so each forward pass pads to a length close
to its members' own, and cut under a budget of padded tokens (longest x count), so a request
of thousands of texts is simply more forward passes. Where to cut weighs padding against the
fixed cost of one more pass.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import numpy as np

T = TypeVar("T")

# What a forward pass costs beyond its tokens, in tokens, where it was not measured: workers
# serving all-MiniLM-L6-v2 on this 2-core machine measured 12-55 at warm-up (docs/performance.md).
DEFAULT_PASS_OVERHEAD_TOKENS = 32


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
                     pad_multiple: int = 1, pass_overhead_tokens: int = DEFAULT_PASS_OVERHEAD_TOKENS) -> list[list[int]]:
    """Group item indices into forward passes, longest first, at the least estimated cost.

    A pass holds at most `max_batch_size` items and at most `max_batch_tokens` padded tokens
    (its longest item's length, rounded up to `pad_multiple`, times its count); an item longer
    than the budget runs alone. Every index appears exactly once.

    A pass costs its padded tokens plus `pass_overhead_tokens`, the time of a pass of nothing
    in units of one token (on a CPU, reading every weight from memory; on a GPU, launching the
    kernels). Over the length-sorted items the best cut is found exactly by dynamic
    programming: few passes where passes are dear, little padding where tokens are. Greedily
    filling each pass to the budget instead lets one pass span lengths from 200 down to 30 on a
    long-tailed batch of 32 texts: measured here, 1.2x slower on one CPU thread.
    """
    if pass_overhead_tokens < 0:
        raise ValueError("pass_overhead_tokens must be >= 0")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    longest = np.array([padded_length(lengths[i], pad_multiple) for i in order], dtype=np.int64)
    count = len(order)
    # cost[j]: the cheapest plan of the first j sorted items; start[j]: where its last pass begins.
    cost = np.zeros(count + 1, dtype=np.float64)
    start = np.zeros(count + 1, dtype=np.int64)
    for end in range(1, count + 1):
        # Sorted descending, so a pass [begin, end) pads to longest[begin] and its shortest is
        # longest[end - 1]; no pass can hold more than the budget allows at that length.
        widest = max(1, min(max_batch_size, end, max_batch_tokens // max(1, longest[end - 1])))
        begins = np.arange(end - widest, end)
        sizes = end - begins
        padded = longest[begins] * sizes
        candidates = cost[begins] + pass_overhead_tokens + padded
        candidates[(padded > max_batch_tokens) & (sizes > 1)] = np.inf
        best = int(np.argmin(candidates))
        cost[end], start[end] = candidates[best], begins[best]
    passes: list[list[int]] = []
    end = count
    while end > 0:
        passes.append(order[start[end]:end])
        end = int(start[end])
    return passes[::-1]
