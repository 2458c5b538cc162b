"""The handler's own metrics: declared once here, measured per batch, sent through the server's adapter,
and written into the server's metrics configuration by the build (it exports only declared
metrics).

Counters give a dashboard rates: texts/s, padding efficiency (rate(real tokens) /
rate(padded tokens)), mean requests per batch, time per stage. One histogram, the handler's time
per batch in seconds (a Prometheus histogram with the standard 5 ms-10 s buckets), gives
latency percentiles; the server's own latency metrics are counters only.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

# Counters are summed across batches and sent at most this often. Each metric line costs the
# worker a log record and the frontend a parse, about 60 us of CPU in all: at ten counter lines
# a batch that was the largest cost of the handler's request path beyond the server's own
# (docs/performance.md). A scrape sees a counter at most this late.
COUNTER_FLUSH_S = 0.5


@dataclass(frozen=True)
class MetricSpec:
    name: str
    unit: str
    help: str
    dimensions: tuple[str, ...] = ()  # before the server's own (ModelName, Level)
    kind: str = "counter"  # or "histogram"


@dataclass
class BatchReport:
    """What one batch cost, filled in by the service."""
    requests: int = 0
    inputs: int = 0
    task: str = "embed"  # what the inputs were: embed (texts), rerank (pairs) or classify
    forward_passes: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    parse_ms: float = 0.0  # route, decode and validate the bodies
    tokenize_ms: float = 0.0  # the task's preparation: prompts, tokenizing, limits
    model_ms: float = 0.0  # forward passes and pooling (and the cache)
    encode_ms: float = 0.0  # normalize, quantize, serialize
    cpu_threads: int = 0  # the most threads a CPU pass ran on, borrowed ones included (0: none ran on a CPU)
    statuses: dict[int, int] = field(default_factory=dict)
    cache_enabled: bool = False
    cache_hits: dict[str, int] = field(default_factory=dict)  # inputs answered from the cache, by tier
    cache_misses: int = 0  # inputs the model computed
    cache_errors: int = 0  # failed Redis calls (the batch went on uncached)

    @property
    def prepare_ms(self) -> float:
        return self.parse_ms + self.tokenize_ms

    def server_timing(self) -> str:
        """The stages as a Server-Timing header value (milliseconds, W3C Server-Timing): what a
        client, a browser's network panel or bench/latency.py reads of the handler's share."""
        threads = f';desc="{self.cpu_threads} CPU threads"' if self.cpu_threads else ""
        return (f"parse;dur={self.parse_ms:.3f}, tokenize;dur={self.tokenize_ms:.3f}, "
                f"model;dur={self.model_ms:.3f}{threads}, encode;dur={self.encode_ms:.3f}")


BATCHES = MetricSpec("EmbedBatches", "count", "batches handled")
REQUESTS = MetricSpec("EmbedRequests", "count", "requests handled")
INPUTS = MetricSpec("EmbedInputs", "count", "inputs embedded (texts, token lists) or scored (pairs, texts), by task "
                    "(embed, rerank, classify)", ("Task",))
PASSES = MetricSpec("EmbedForwardPasses", "count", "forward passes run")
REAL_TOKENS = MetricSpec("EmbedRealTokens", "count", "tokens of the inputs")
PADDED_TOKENS = MetricSpec("EmbedPaddedTokens", "count", "tokens computed, padding included")
PREPARE_MS = MetricSpec("EmbedPrepareMs", "ms", "time parsing, validating and tokenizing")
MODEL_MS = MetricSpec("EmbedModelMs", "ms", "time in forward passes and pooling")
ENCODE_MS = MetricSpec("EmbedEncodeMs", "ms", "time normalizing, quantizing and serializing")
BATCH_SECONDS = MetricSpec("EmbedBatchSeconds", "s", "handler time per batch", kind="histogram")
RESPONSES = MetricSpec("EmbedResponses", "count", "responses by HTTP status", ("Status",))
CACHE_HITS = MetricSpec("EmbedCacheHits", "count", "inputs answered from the cache, by tier (memory, redis)", ("Tier",))
CACHE_MISSES = MetricSpec("EmbedCacheMisses", "count", "inputs the cache did not hold")
CACHE_ERRORS = MetricSpec("EmbedCacheErrors", "count", "failed Redis calls; the batch was served uncached")

ALL = (BATCHES, REQUESTS, INPUTS, PASSES, REAL_TOKENS, PADDED_TOKENS, PREPARE_MS, MODEL_MS, ENCODE_MS,
       BATCH_SECONDS, RESPONSES, CACHE_HITS, CACHE_MISSES, CACHE_ERRORS)


Row = tuple[MetricSpec, float, tuple[str, ...]]  # metric, value, values of its own dimensions


def measurements(report: BatchReport) -> list[Row]:
    """(metric, value, values of its own dimensions) for one batch."""
    rows = [
        (BATCHES, 1, ()),
        (REQUESTS, report.requests, ()),
        (INPUTS, report.inputs, (report.task,)),
        (PASSES, report.forward_passes, ()),
        (REAL_TOKENS, report.real_tokens, ()),
        (PADDED_TOKENS, report.padded_tokens, ()),
        (PREPARE_MS, round(report.prepare_ms, 3), ()),
        (MODEL_MS, round(report.model_ms, 3), ()),
        (ENCODE_MS, round(report.encode_ms, 3), ()),
        (BATCH_SECONDS, round((report.prepare_ms + report.model_ms + report.encode_ms) / 1000, 6), ()),
    ]
    rows += [(RESPONSES, count, (str(status),)) for status, count in sorted(report.statuses.items())]
    if report.cache_enabled:  # a model without a cache exports no cache series
        rows += [(CACHE_HITS, report.cache_hits.get(tier, 0), (tier,)) for tier in ("memory", "redis")]
        rows += [(CACHE_MISSES, report.cache_misses, ()), (CACHE_ERRORS, report.cache_errors, ())]
    return rows


class MetricBuffer:
    """Sends histogram observations as they come (one per batch) and counters as sums, at most
    every `interval_s`: with the batch that finds the interval over, or from a timer when no
    batch comes. A zero adds nothing to a series already sent and is dropped; the first one is
    sent, so every series exists (with 0) from the first batch that measures it.

    `send` is called with the rows to send, from the caller's thread or from the timer's, never
    from two at once. Counters of the last interval are lost if the process dies before it ends.
    """

    def __init__(self, send: Callable[[list[Row]], None], interval_s: float = COUNTER_FLUSH_S,
                 clock: Callable[[], float] = time.monotonic):
        self._send = send
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[MetricSpec, tuple[str, ...]], float] = {}
        self._sent: set[tuple[MetricSpec, tuple[str, ...]]] = set()
        self._last_flush = -math.inf
        self._timer: threading.Timer | None = None

    def add(self, report: BatchReport) -> None:
        with self._lock:
            rows: list[Row] = []
            for spec, value, dimension_values in measurements(report):
                series = (spec, dimension_values)
                if spec.kind != "counter":
                    rows.append((spec, value, dimension_values))
                elif value or (series not in self._sent and series not in self._pending):
                    self._pending[series] = self._pending.get(series, 0) + value
            wait = self._last_flush + self._interval_s - self._clock()
            if self._pending and wait <= 0:
                rows += self._take()
            elif self._pending and self._timer is None:
                self._timer = threading.Timer(wait, self.flush)
                self._timer.daemon = True
                self._timer.start()
            if rows:
                self._send(rows)

    def flush(self) -> None:
        """Send the pending counter sums now."""
        with self._lock:
            rows = self._take()
            if not rows:
                return
            try:
                self._send(rows)
            except Exception:  # from the timer's thread: a metric must never take anything down
                log.exception("sending %d metric rows failed", len(rows))

    def _take(self) -> list[Row]:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        rows = [(spec, round(value, 6), dimension_values) for (spec, dimension_values), value in self._pending.items()]
        self._sent.update(self._pending)
        self._pending = {}
        self._last_flush = self._clock()
        return rows
