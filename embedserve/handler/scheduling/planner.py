"""Batch planning: flatten requests into one item list, cut it into forward passes, split back.

Items are sorted by token length before cutting, so each forward pass pads to a length close
to its members' own, and cut under a budget of padded tokens (longest x count), so a request
of thousands of texts is simply more forward passes. Where to cut weighs padding against the
fixed cost of one more pass. Where a device replays passes in CUDA graph buckets, a pass is
priced at the bucket it would replay in, so the cuts fill buckets instead of spilling over them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterable, Sequence, TypeVar

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


class BucketTable:
    """The (batch, length) shapes a device replays passes in, as a lookup: a pass of `rows` rows
    padded to `length` replays in the bucket that holds it with the fewest tokens, and computes
    all of that bucket's tokens."""

    def __init__(self, buckets: Iterable[tuple[int, int]]):
        shapes = set(buckets)
        self.lengths = sorted({length for _, length in shapes})
        widest = max((batch for batch, _ in shapes), default=0)
        # tokens[level, rows]: the fewest tokens of a bucket holding `rows` rows of a length up to
        # lengths[level]; 0 where none does. The last row (longer than every bucket) and the last
        # column (more rows than every bucket) are all 0.
        self.tokens = np.zeros((len(self.lengths) + 1, widest + 2), dtype=np.int64)
        for level, length in enumerate(self.lengths):
            for rows in range(1, widest + 1):
                self.tokens[level, rows] = min((b * n for b, n in shapes if b >= rows and n >= length), default=0)

    def level(self, length: int) -> int:
        """The row of `tokens` for passes padded to `length`."""
        return bisect_left(self.lengths, length)

    def up_to(self, max_rows: int) -> np.ndarray:
        """`tokens` with a column for every count of rows up to max_rows."""
        tokens = np.zeros((self.tokens.shape[0], max_rows + 1), dtype=np.int64)
        width = min(max_rows + 1, self.tokens.shape[1])
        tokens[:, :width] = self.tokens[:, :width]
        return tokens

    def bucket_tokens(self, rows: int, length: int) -> int:
        """Tokens of the bucket a (rows, length) pass replays in; 0 where none holds it."""
        return int(self.tokens[self.level(length), min(rows, self.tokens.shape[1] - 1)])


@dataclass(frozen=True)
class Replay:
    """A device that replays passes in CUDA graph buckets: their shapes, and what one replay costs
    beyond its tokens, in tokens (a replay launches its kernels at once, an eager pass one by one)."""
    buckets: BucketTable
    overhead_tokens: int


def plan_sub_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int,
                     pad_multiple: int = 1, pass_overhead_tokens: int = DEFAULT_PASS_OVERHEAD_TOKENS,
                     replay: Replay | None = None) -> list[list[int]]:
    """Group item indices into forward passes, longest first, at the least estimated cost.

    A pass holds at most `max_batch_size` items and at most `max_batch_tokens` padded tokens
    (its longest item's length, rounded up to `pad_multiple`, times its count); an item longer
    than the budget runs alone. Every index appears exactly once.

    A pass costs its padded tokens plus `pass_overhead_tokens`, the time of a pass of nothing
    in units of one token (on a CPU, reading every weight from memory; on a GPU, launching the
    kernels). With `replay`, a pass that a bucket holds costs that bucket's tokens (the device
    computes all of them) plus `replay.overhead_tokens`; a pass no bucket holds runs eagerly, at
    the cost above. Over the length-sorted items the best cut is found exactly by dynamic
    programming: few passes where passes are dear, little padding where tokens are. Greedily
    filling each pass to the budget instead lets one pass span lengths from 200 down to 30 on a
    long-tailed batch of 32 texts: measured here, 1.2x slower on one CPU thread.
    """
    if pass_overhead_tokens < 0:
        raise ValueError("pass_overhead_tokens must be >= 0")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    longest = [padded_length(lengths[i], pad_multiple) for i in order]
    count = len(order)
    if replay is not None:
        # bucket_tokens[levels[i], size]: the tokens of the bucket that a pass of `size` items led
        # by sorted item i replays in; 0 where it runs eagerly.
        bucket_tokens = replay.buckets.up_to(max(1, min(max_batch_size, count)))
        levels = [replay.buckets.level(length) for length in longest]
        bucket_rows = bucket_tokens.tolist()
        item_buckets = [bucket_rows[level] for level in levels]  # the same, per item, for plain Python
    # cost[j]: the cheapest plan of the first j sorted items; start[j]: where its last pass begins.
    cost = [0.0] * (count + 1)
    start = [0] * (count + 1)
    arrays: tuple[np.ndarray, ...] | None = None  # made at the first wide window
    for end in range(1, count + 1):
        # Sorted descending, so a pass [begin, end) pads to longest[begin] and its shortest is
        # longest[end - 1]; no pass can hold more than the budget allows at that length. Its
        # padded tokens only grow as it begins earlier, so the passes over the budget come first.
        # Ties go to the earliest begin (the fewest passes).
        widest = max(1, min(max_batch_size, end, max_batch_tokens // max(1, longest[end - 1])))
        if widest <= NUMPY_WINDOW:
            best, best_begin = float("inf"), end - 1
            for begin in range(end - 1, end - widest - 1, -1):
                size = end - begin
                padded = longest[begin] * size
                if padded > max_batch_tokens and size > 1:  # a single item runs whatever its length
                    break
                if replay is None:
                    price = pass_overhead_tokens + padded
                else:
                    bucket = item_buckets[begin][size]
                    price = replay.overhead_tokens + bucket if bucket else pass_overhead_tokens + padded
                candidate = cost[begin] + price
                if candidate <= best:
                    best, best_begin = candidate, begin
        else:
            if arrays is None:
                arrays = (np.array(cost), np.array(longest, dtype=np.int64),
                          np.arange(count, 0, -1, dtype=np.int64),  # pass sizes, count down to 1
                          np.array(levels if replay is not None else [], dtype=np.int64))
            cost_array, longest_array, sizes, level_array = arrays
            first = end - widest
            pass_sizes = sizes[count - widest:]
            padded_tokens = longest_array[first:end] * pass_sizes
            prices = pass_overhead_tokens + padded_tokens
            if replay is not None:
                bucket = bucket_tokens[level_array[first:end], pass_sizes]
                prices = np.where(bucket > 0, replay.overhead_tokens + bucket, prices)
            candidates = cost_array[first:end] + prices
            over = int(np.count_nonzero(padded_tokens[:-1] > max_batch_tokens))
            best_index = over + int(np.argmin(candidates[over:]))
            best, best_begin = float(candidates[best_index]), first + best_index
        cost[end], start[end] = best, best_begin
        if arrays is not None:
            arrays[0][end] = best
    passes: list[list[int]] = []
    end = count
    while end > 0:
        passes.append(order[start[end]:end])
        end = start[end]
    return passes[::-1]


def plan_packed(lengths: Sequence[int], max_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group item indices into packed passes (embedserve/handler/backends/packed.py), longest first: a packed pass
    computes only its real tokens, so there is no padding to weigh and the fewest passes win.
    Each holds at most `max_batch_size` items and `max_tokens` tokens; a longer item runs alone."""
    passes: list[list[int]] = []
    tokens = max_tokens + 1  # no open pass yet
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        if tokens + lengths[index] > max_tokens or len(passes[-1]) >= max_batch_size:
            passes.append([])
            tokens = 0
        passes[-1].append(index)
        tokens += lengths[index]
    return passes
