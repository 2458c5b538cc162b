"""Which padded CUDA graph buckets an engine captures: none it could never use."""

from embedserve.handler.backends.cuda_graphs import ladder
from embedserve.handler.execution.select import usable_buckets

BUCKETS = ladder([1, 2, 4, 8, 16, 32], [16, 32, 64, 128, 256, 512], max_tokens=16384)


def lengths(buckets) -> list[int]:
    return sorted({b.length for b in buckets})


def test_no_bucket_longer_than_the_longest_input_needs():
    # MiniLM: inputs cut at 256 tokens, position table of 512: the 512-token buckets never replay.
    assert lengths(usable_buckets(BUCKETS, max_length=256, max_positions=512)) == [16, 32, 64, 128, 256]


def test_the_shortest_bucket_that_holds_the_longest_input_is_kept():
    assert lengths(usable_buckets(BUCKETS, max_length=300, max_positions=512)) == [16, 32, 64, 128, 256, 512]
    assert lengths(usable_buckets(BUCKETS, max_length=100, max_positions=None)) == [16, 32, 64, 128]


def test_never_past_the_position_table():
    # An input longer than every bucket within the table runs eagerly; the buckets that fit stay.
    assert lengths(usable_buckets(BUCKETS, max_length=1000, max_positions=128)) == [16, 32, 64, 128]
    assert usable_buckets(BUCKETS, max_length=8, max_positions=8) == []
