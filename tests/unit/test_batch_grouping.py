"""embedserve batch's grouping of table rows into requests: every row once, in order, and every
request within the server's limits as the handler counts them."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from embedserve.batch.grouping import Budget, groups
from embedserve.batch.inputs import Row
from embedserve.batch.server import Limits
from embedserve.handler.api.route import Route
from embedserve.handler.tasks.embed import max_answer_bytes

LIMITS = Limits(task="embed", dimension=384, max_inputs=4096, max_input_chars=100_000, max_input_length=256,
                max_tokens_per_request=1_048_576, max_batch_work_tokens=152_000, max_response_bytes=27_001_094)


def rows_of(texts):
    return [Row(i, t) for i, t in enumerate(texts)]


def flatten(found):
    return [row for group in found for row in group.rows]


def test_rows_per_request_and_order():
    rows = rows_of([f"text {i}" for i in range(300)])
    found = list(groups(iter(rows), Budget.of(LIMITS, concurrency=4, dimensions=384, model="minilm", rows=128)))
    assert [len(g.rows) for g in found] == [128, 128, 44]
    assert flatten(found) == rows


def test_the_servers_inputs_limit_wins_over_the_option():
    limits = Limits(**{**LIMITS.__dict__, "max_inputs": 10})
    found = list(groups(iter(rows_of(["x"] * 25)), Budget.of(limits, 4, 384, "m", rows=128)))
    assert [len(g.rows) for g in found] == [10, 10, 5]


def test_tokens_per_request_hold_with_the_byte_bound():
    # 100 ASCII bytes bound a text at 102 tokens: 3 fit under 310, a 4th would not
    limits = Limits(**{**LIMITS.__dict__, "max_tokens_per_request": 310, "max_batch_work_tokens": 10**9})
    found = list(groups(iter(rows_of(["a" * 100] * 7)), Budget.of(limits, 1, 384, "m")))
    assert [len(g.rows) for g in found] == [3, 3, 1]


def test_truncation_caps_a_long_texts_tokens():
    # 10,000 bytes are at most max_input_length=256 tokens after truncation
    limits = Limits(**{**LIMITS.__dict__, "max_tokens_per_request": 1024, "max_batch_work_tokens": 10**9})
    found = list(groups(iter(rows_of(["word " * 2000] * 9)), Budget.of(limits, 1, 384, "m")))
    assert [len(g.rows) for g in found] == [4, 4, 1]


def test_answer_bytes_as_the_handler_counts_them_fit():
    limits = Limits(**{**LIMITS.__dict__, "max_response_bytes": 100_000})
    budget = Budget.of(limits, 1, 384, "minilm")
    found = list(groups(iter(rows_of(["short"] * 500)), budget))
    for group in found:
        counted = max_answer_bytes(len(group.texts), 384, "float", "base64", "minilm", Route.OPENAI)
        assert counted <= limits.max_response_bytes
    # and the groups are as large as that allows: one more row would not fit
    largest = len(found[0].texts)
    assert max_answer_bytes(largest + 1, 384, "float", "base64", "minilm", Route.OPENAI) > limits.max_response_bytes


def test_requests_in_flight_share_the_batch_work_bound():
    # 8 in flight, twice over: 152,000 / 16 = 9,500 estimated tokens a request; 300 bytes ~ 102 tokens
    found = list(groups(iter(rows_of(["b" * 300] * 400)), Budget.of(LIMITS, 8, 384, "m", rows=4096)))
    assert len(found[0].rows) == 9500 // 102
    assert flatten(found) == rows_of(["b" * 300] * 400)


def test_rows_the_server_would_refuse_are_not_sent():
    texts = ["good", None, "", "x" * 100_001, "bad \ud800 surrogate", "also good"]
    [group] = groups(iter(rows_of(texts)), Budget.of(LIMITS, 1, 384, "m"))
    assert group.texts == ["good", "also good"]
    assert sorted(group.refused) == [1, 2, 3, 4]
    assert "max_input_chars=100000" in group.refused[3]
    assert "surrogate" in group.refused[4]


def test_a_run_of_refused_rows_stays_bounded():
    found = list(groups(iter(rows_of([None] * 1000)), Budget.of(LIMITS, 1, 384, "m", rows=100)))
    assert [len(g.rows) for g in found] == [100] * 10
    assert all(not g.texts for g in found)


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.one_of(st.none(), st.text(max_size=400)), max_size=120),
       rows=st.integers(1, 50), max_tokens=st.integers(300, 5000), work=st.integers(1, 50_000),
       answer=st.integers(2_000, 200_000), concurrency=st.integers(1, 16))
def test_every_row_once_in_order_within_every_limit(texts, rows, max_tokens, work, answer, concurrency):
    limits = Limits(task="embed", dimension=32, max_inputs=rows, max_input_chars=300, max_input_length=64,
                    max_tokens_per_request=max_tokens, max_batch_work_tokens=work, max_response_bytes=answer)
    budget = Budget.of(limits, concurrency, 32, "tiny", rows=4096)
    found = list(groups(iter(rows_of(texts)), budget))
    assert flatten(found) == rows_of(texts)
    for group in found:
        sent = group.texts
        assert len(group.rows) <= rows
        if len(sent) > 1:  # one text alone is sent whatever it is; the server says whether it fits
            assert sum(min(64, len(t.encode()) + 2) for t in sent) <= max_tokens
            assert max_answer_bytes(len(sent), 32, "float", "base64", "tiny", Route.OPENAI) <= answer
