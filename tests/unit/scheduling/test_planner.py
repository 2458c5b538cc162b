import random

import pytest

from embedserve.handler.scheduling.planner import BucketTable, Replay, flatten, padded_length, plan_packed, plan_sub_batches


def test_flatten_keeps_spans_back_to_each_group():
    items, spans = flatten([["a", "b"], ["c"], ["d", "e", "f"]])
    assert items == ["a", "b", "c", "d", "e", "f"]
    assert [items[s] for s in spans] == [["a", "b"], ["c"], ["d", "e", "f"]]


def test_flatten_of_nothing():
    assert flatten([]) == ([], [])


@pytest.mark.parametrize("seed", range(5))
def test_plan_covers_every_item_once_under_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 256) for _ in range(500)]
    plan = plan_sub_batches(lengths, max_batch_tokens=2048, max_batch_size=32)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        padded = max(lengths[i] for i in batch) * len(batch)
        assert len(batch) <= 32
        assert padded <= 2048 or len(batch) == 1


def test_plan_sorts_longest_first_so_batches_pad_little():
    lengths = [5, 100, 6, 99, 7, 98]
    plan = plan_sub_batches(lengths, max_batch_tokens=300, max_batch_size=3)
    assert plan == [[1, 3, 5], [4, 2, 0]]


def test_an_item_over_the_budget_runs_alone():
    assert plan_sub_batches([10, 500, 10], max_batch_tokens=100, max_batch_size=8) == [[1], [0, 2]]


def test_empty_plan():
    assert plan_sub_batches([], max_batch_tokens=100, max_batch_size=8) == []


def test_padded_length_rounds_up_to_the_multiple():
    assert [padded_length(n, 8) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
    assert padded_length(13, 1) == 13


def test_pad_multiple_counts_in_the_budget():
    # Length 9 pads to 16: two of them cost 32 padded tokens, over a budget of 24.
    assert plan_sub_batches([9, 9], max_batch_tokens=24, max_batch_size=8, pad_multiple=8) == [[0], [1]]
    assert plan_sub_batches([9, 9], max_batch_tokens=24, max_batch_size=8) == [[0, 1]]


def test_sorting_keeps_padding_low_on_a_long_tail():
    rng = random.Random(1)
    lengths = [min(256, max(4, int(rng.lognormvariate(3.6, 0.9)))) for _ in range(1000)]
    real = sum(lengths)
    sorted_padded = sum(max(lengths[i] for i in b) * len(b) for b in plan_sub_batches(lengths, 4096, 64))
    fifo_padded = sum(max(lengths[i:i + 64]) * len(lengths[i:i + 64]) for i in range(0, len(lengths), 64))
    assert real / sorted_padded > 0.9 > real / fifo_padded


def _plan_cost(lengths, plan, overhead):
    return sum(overhead + max(lengths[i] for i in batch) * len(batch) for batch in plan)


def _cheapest_cost(lengths, max_batch_tokens, max_batch_size, price):
    """Every cut of the length-sorted items into consecutive passes, by brute force; a pass of
    `size` items padded to `longest` costs price(longest, size)."""
    ordered = sorted(lengths, reverse=True)
    best = [0.0] + [float("inf")] * len(ordered)
    for end in range(1, len(ordered) + 1):
        for begin in range(end):
            size = end - begin
            if size > max_batch_size or (size > 1 and ordered[begin] * size > max_batch_tokens):
                continue
            best[end] = min(best[end], best[begin] + price(ordered[begin], size))
    return best[-1]


@pytest.mark.parametrize("seed", range(20))
def test_plan_is_the_cheapest_cut_of_the_sorted_items(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 40))]
    overhead = rng.choice([0, 8, 32, 200])
    plan = plan_sub_batches(lengths, max_batch_tokens=256, max_batch_size=6, pass_overhead_tokens=overhead)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    assert all(len(b) <= 6 and (len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 256) for b in plan)
    assert _plan_cost(lengths, plan, overhead) == _cheapest_cost(lengths, 256, 6,
                                                                 lambda longest, size: overhead + longest * size)


def test_dear_passes_are_filled_and_cheap_ones_follow_the_lengths():
    lengths = [100, 90, 60, 50, 20, 10]
    # Passes cost nothing extra: every input runs alone, with no padding at all.
    assert plan_sub_batches(lengths, 1000, 8, pass_overhead_tokens=0) == [[0], [1], [2], [3], [4], [5]]
    # Passes cost more than any padding could: one pass, as the budget allows.
    assert plan_sub_batches(lengths, 1000, 8, pass_overhead_tokens=10_000) == [[0, 1, 2, 3, 4, 5]]
    # In between, the cut falls where the lengths jump.
    assert plan_sub_batches(lengths, 1000, 8, pass_overhead_tokens=40) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("seed", range(6))
def test_a_long_tailed_batch_of_32_pads_little(seed):
    # One TorchServe batch of 32 single-text requests. Filling every pass to the budget (what
    # a huge pass cost asks for) pads it to 46-72% efficiency; at a CPU's pass cost, > 90%.
    rng = random.Random(seed)
    lengths = [min(256, max(4, int(rng.lognormvariate(3.6, 0.9)))) for _ in range(32)]

    def efficiency(overhead):
        plan = plan_sub_batches(lengths, 2048, 256, pass_overhead_tokens=overhead)
        return sum(lengths) / sum(max(lengths[i] for i in b) * len(b) for b in plan)

    assert efficiency(32) > 0.9
    assert efficiency(10_000) < 0.75


def test_negative_pass_overhead_is_refused():
    with pytest.raises(ValueError, match="pass_overhead_tokens"):
        plan_sub_batches([1, 2], 100, 8, pass_overhead_tokens=-1)


# Passes a device replays in CUDA graph buckets (embedserve/handler/backends/cuda_graphs.py): the planner prices each
# pass at the bucket it would replay in.

LADDER = [(b, n) for b in (1, 2, 4, 8, 16, 32, 64) for n in (16, 32, 64, 128, 256, 512) if b * n <= 16384]


def _bucket_tokens(buckets, rows, length):
    """The fewest tokens of a bucket holding the pass, by brute force; 0 where none does."""
    return min((b * n for b, n in buckets if b >= rows and n >= length), default=0)


def test_bucket_table_finds_the_smallest_bucket_that_holds_a_pass():
    table = BucketTable(LADDER)
    for rows in range(1, 70):
        for length in range(1, 520, 7):
            assert table.bucket_tokens(rows, length) == _bucket_tokens(LADDER, rows, length), (rows, length)
    assert BucketTable([]).bucket_tokens(1, 1) == 0


def _replay_cost(lengths, plan, buckets, overhead, replay_overhead, pad_multiple=1):
    """A plan's cost where the device replays passes in `buckets`, eager where none holds them."""
    total = 0
    for batch in plan:
        padded_len = padded_length(max(lengths[i] for i in batch), pad_multiple)
        bucket = _bucket_tokens(buckets, len(batch), padded_len)
        total += replay_overhead + bucket if bucket else overhead + padded_len * len(batch)
    return total


def _replay_price(buckets, overhead, replay_overhead):
    """A pass's cost where a bucket holds it: replayed at the bucket's tokens, else eager."""
    def price(longest, size):
        bucket = _bucket_tokens(buckets, size, longest)
        return replay_overhead + bucket if bucket else overhead + longest * size
    return price


@pytest.mark.parametrize("seed", range(12))
def test_plan_with_buckets_is_the_cheapest_cut_at_bucket_prices(seed):
    rng = random.Random(seed)
    # Up to 150 items and passes of up to 100: the wide windows take the numpy path.
    lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 150))]
    buckets = [(b, n) for b in (1, 2, 4, 8, 32, 100) for n in (8, 16, 32, 64, 128) if b * n <= 4096]
    overhead, replay_overhead = rng.choice([(32, 32), (400, 20), (2000, 50)])
    plan = plan_sub_batches(lengths, 4096, 100, pass_overhead_tokens=overhead,
                            replay=Replay(BucketTable(buckets), replay_overhead))
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    assert all(len(b) <= 100 and (len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 4096) for b in plan)
    assert _replay_cost(lengths, plan, buckets, overhead, replay_overhead) == \
        _cheapest_cost(lengths, 4096, 100, _replay_price(buckets, overhead, replay_overhead))


def _mixed_corpus(rng, count):
    """Half short queries (about 14 tokens), half passages (about 100, a long tail)."""
    return [min(512, max(3, int(rng.lognormvariate(2.6, 0.5)))) if rng.random() < 0.5
            else min(512, max(8, int(rng.lognormvariate(4.6, 0.7)))) for _ in range(count)]


@pytest.mark.parametrize("count", [16, 64, 256, 1024])
def test_plans_priced_at_their_buckets_fill_them(count):
    # The default ladder and GPU budget. Planned blind to the buckets, passes spill into buckets
    # twice their size (about 0.55 real tokens per computed token, measured here); priced at
    # their buckets, they fill them, and the estimated cost only falls.
    rng = random.Random(count)
    table = BucketTable(LADDER)
    blind_efficiency = aware_efficiency = 0.0
    for _ in range(10):
        lengths = _mixed_corpus(rng, count)
        blind = plan_sub_batches(lengths, 16384, 256, 8, pass_overhead_tokens=32)
        aware = plan_sub_batches(lengths, 16384, 256, 8, pass_overhead_tokens=32, replay=Replay(table, 32))
        computed = {name: _replay_cost(lengths, plan, LADDER, 0, 0, pad_multiple=8)
                    for name, plan in (("blind", blind), ("aware", aware))}
        blind_efficiency += sum(lengths) / computed["blind"] / 10
        aware_efficiency += sum(lengths) / computed["aware"] / 10
        assert _replay_cost(lengths, aware, LADDER, 32, 32, 8) <= _replay_cost(lengths, blind, LADDER, 32, 32, 8)
    assert blind_efficiency < 0.62 and aware_efficiency > 0.65
    assert aware_efficiency > blind_efficiency + 0.08


def test_a_pass_no_bucket_holds_runs_eager_at_its_own_size():
    # 100 inputs of 16 tokens: no bucket holds 100 rows. Where an eager pass costs what a replay
    # does, one eager pass of 1600 tokens; where it costs more, replays that fill their buckets
    # (64 + 32 + 4 rows: 36 rows would replay in the 64x16 bucket).
    table = BucketTable(LADDER)
    cheap_eager = plan_sub_batches([16] * 100, 16384, 256, 8, pass_overhead_tokens=32, replay=Replay(table, 32))
    assert [len(b) for b in cheap_eager] == [100]
    dear_eager = plan_sub_batches([16] * 100, 16384, 256, 8, pass_overhead_tokens=2000, replay=Replay(table, 50))
    assert sorted(len(b) for b in dear_eager) == [4, 32, 64]


def test_packed_plan_fills_passes_by_total_tokens_longest_first():
    lengths = [5, 300, 40, 40, 7, 1, 90, 600]
    passes = plan_packed(lengths, max_tokens=128, max_batch_size=3)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    assert passes[:3] == [[7], [1], [6]]  # longer than the budget, or nothing else fits beside it: alone
    for indices in passes:
        assert len(indices) <= 3 and (len(indices) == 1 or sum(lengths[i] for i in indices) <= 128)
    assert passes[3:] == [[2, 3, 4], [0, 5]]
