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
# The planner weighs up to this many candidate passes per step in plain Python, more with numpy,
# whose fixed cost per call pays only on wide windows (measured: 32 items 0.1 ms instead of
# 0.5-0.7 ms; 4096 items of up to 256 per pass, about 2x faster than numpy at every step).
NUMPY_WINDOW = 64


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
    longest = [padded_length(lengths[i], pad_multiple) for i in order]
    count = len(order)
    # cost[j]: the cheapest plan of the first j sorted items; start[j]: where its last pass begins.
    cost = [0.0] * (count + 1)
    start = [0] * (count + 1)
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # made at the first wide window
    for end in range(1, count + 1):
        # Sorted descending, so a pass [begin, end) pads to longest[begin] and its shortest is
        # longest[end - 1]; no pass can hold more than the budget allows at that length. Its
        # padded tokens only grow as it begins earlier, so the passes over the budget come first.
        # Ties go to the earliest begin (the fewest passes).
        widest = max(1, min(max_batch_size, end, max_batch_tokens // max(1, longest[end - 1])))
        if widest <= NUMPY_WINDOW:
            best_begin = end - 1
            best = cost[best_begin] + pass_overhead_tokens + longest[best_begin]
            for begin in range(end - 2, end - widest - 1, -1):
                padded = longest[begin] * (end - begin)
                if padded > max_batch_tokens:
                    break
                candidate = cost[begin] + pass_overhead_tokens + padded
                if candidate <= best:
                    best, best_begin = candidate, begin
        else:
            if arrays is None:
                arrays = (np.array(cost), np.array(longest, dtype=np.int64),
                          np.arange(count, 0, -1, dtype=np.int64))  # pass sizes, count down to 1
            cost_array, longest_array, sizes = arrays
            first = end - widest
            padded_tokens = longest_array[first:end] * sizes[count - widest:]
            candidates = cost_array[first:end] + padded_tokens
            over = int(np.count_nonzero(padded_tokens[:-1] > max_batch_tokens))
            best_index = over + int(np.argmin(candidates[over:]))
            best, best_begin = float(candidates[best_index]) + pass_overhead_tokens, first + best_index
        cost[end], start[end] = best, best_begin
        if arrays is not None:
            arrays[0][end] = best
    passes: list[list[int]] = []
    end = count
    while end > 0:
        passes.append(order[start[end]:end])
        end = start[end]
    return passes[::-1]
