"""The handler sends each of its series from the first batch that measures it, counters summed
between flushes and histograms per batch (the metrics the shipped dashboards read:
tests/unit/archive/test_metrics_config.py)."""


class Sent:
    """MetricBuffer's send: the rows sent, as (name, value, dimension values)."""

    def __init__(self):
        self.lines = []

    def __call__(self, rows):
        self.lines += [(spec.name, value, dimension_values) for spec, value, dimension_values in rows]

    def take(self):
        lines, self.lines = self.lines, []
        return lines


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def batch(requests=1, model_ms=1.0, status=200):
    from embedserve.handler.worker.metrics import BatchReport
    return BatchReport(requests=requests, inputs=requests, forward_passes=1, real_tokens=3 * requests,
                       padded_tokens=3 * requests, model_ms=model_ms, statuses={status: requests},
                       cache_enabled=True, cache_misses=requests)


def test_a_zero_counter_is_sent_once_so_its_series_exists():
    from embedserve.handler.worker.metrics import ALL, BatchReport, MetricBuffer

    sent, clock = Sent(), Clock()
    buffer = MetricBuffer(sent, interval_s=10, clock=clock)
    buffer.add(BatchReport(requests=2, statuses={400: 2}, cache_enabled=True))
    assert {name for name, _, _ in sent.take()} == {spec.name for spec in ALL}  # zeros included
    clock.now += 10
    buffer.add(batch())
    assert {name: value for name, value, _ in sent.take()} == {
        "EmbedBatches": 1, "EmbedRequests": 1, "EmbedInputs": 1, "EmbedForwardPasses": 1, "EmbedRealTokens": 3,
        "EmbedPaddedTokens": 3, "EmbedModelMs": 1.0, "EmbedBatchSeconds": 0.001, "EmbedResponses": 1,
        "EmbedCacheMisses": 1}  # no zeros: their series exist


def test_counters_are_summed_between_flushes_and_histograms_sent_per_batch():
    from embedserve.handler.worker.metrics import MetricBuffer

    sent, clock = Sent(), Clock()
    buffer = MetricBuffer(sent, interval_s=10, clock=clock)
    buffer.add(batch())
    sent.take()
    buffer.add(batch(requests=2, model_ms=2.0))
    buffer.add(batch(requests=3, model_ms=4.0, status=400))
    assert sent.take() == [("EmbedBatchSeconds", 0.002, ()), ("EmbedBatchSeconds", 0.004, ())]
    clock.now += 10
    buffer.add(batch(requests=4, model_ms=1.0))
    lines = sent.take()
    assert ("EmbedBatchSeconds", 0.001, ()) in lines
    counters = {(name, dimension_values): value for name, value, dimension_values in lines
                if name != "EmbedBatchSeconds"}
    assert counters[("EmbedBatches", ())] == 3 and counters[("EmbedRequests", ())] == 9
    assert counters[("EmbedModelMs", ())] == 7.0 and counters[("EmbedRealTokens", ())] == 27
    assert counters[("EmbedResponses", ("200",))] == 6 and counters[("EmbedResponses", ("400",))] == 3
    clock.now += 10
    buffer.flush()
    assert sent.take() == []  # nothing pending


def test_a_timer_sends_the_last_counters_when_no_batch_follows():
    import time

    from embedserve.handler.worker.metrics import MetricBuffer

    sent = Sent()
    buffer = MetricBuffer(sent, interval_s=0.2)
    buffer.add(batch())
    sent.take()
    buffer.add(batch(requests=5))
    assert [name for name, _, _ in sent.lines] == ["EmbedBatchSeconds"]  # counters wait for the interval
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and ("EmbedRequests", 5, ()) not in sent.lines:
        time.sleep(0.02)
    assert ("EmbedRequests", 5, ()) in sent.lines


def test_a_failing_send_from_the_timer_is_logged_not_raised(caplog):
    import time

    from embedserve.handler.worker.metrics import MetricBuffer

    calls = []

    def send(rows):
        calls.append(rows)
        if len(calls) > 2:
            raise OSError("stdout closed")

    buffer = MetricBuffer(send, interval_s=0.1)
    buffer.add(batch())
    buffer.add(batch())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "sending" not in caplog.text:
        time.sleep(0.02)
    assert "sending" in caplog.text and len(calls) == 3


def test_a_batch_s_stages_read_as_a_server_timing_header():
    import pytest

    from embedserve.handler.worker.metrics import BatchReport

    report = BatchReport(parse_ms=0.1234, tokenize_ms=0.5, model_ms=7.25, encode_ms=0.2, cpu_threads=2)
    assert report.server_timing() == \
        'parse;dur=0.123, tokenize;dur=0.500, model;dur=7.250;desc="2 CPU threads", encode;dur=0.200'
    assert report.prepare_ms == pytest.approx(0.6234)
    assert "desc" not in BatchReport(model_ms=1.0).server_timing()  # no CPU pass (a GPU, a cache hit)
