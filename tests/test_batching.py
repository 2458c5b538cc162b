import random

import pytest

from handler.batching import flatten, plan_sub_batches


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
