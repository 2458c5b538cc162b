"""The handler's own metrics: declared once here, emitted per batch by ts_handler.py, and written
into TorchServe's metrics configuration by the build (TorchServe exports only declared metrics).

Counters give a dashboard rates: texts/s, padding efficiency (rate(real tokens) /
rate(padded tokens)), mean requests per batch, time per stage. One histogram, the handler's time
per batch in seconds (TorchServe's Prometheus histogram has the standard 5 ms-10 s buckets),
gives latency percentiles; TorchServe's own latency metrics are counters only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MetricSpec:
    name: str
    unit: str
    help: str
    dimensions: tuple[str, ...] = ()  # before TorchServe's own ModelName and Level
    kind: str = "counter"  # or "histogram"


@dataclass
class BatchReport:
    """What one TorchServe batch cost, filled in by the engine."""
    requests: int = 0
    inputs: int = 0
    forward_passes: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    prepare_ms: float = 0.0  # parse, validate, tokenize
    model_ms: float = 0.0  # forward passes and pooling
    encode_ms: float = 0.0  # normalize, quantize, serialize
    statuses: dict[int, int] = field(default_factory=dict)
    cache_enabled: bool = False
    cache_hits: dict[str, int] = field(default_factory=dict)  # inputs answered from the cache, by tier
    cache_misses: int = 0  # inputs the model computed
    cache_errors: int = 0  # failed Redis calls (the batch went on uncached)


BATCHES = MetricSpec("EmbedBatches", "count", "TorchServe batches handled")
REQUESTS = MetricSpec("EmbedRequests", "count", "requests handled")
INPUTS = MetricSpec("EmbedInputs", "count", "inputs (texts or token lists) embedded")
PASSES = MetricSpec("EmbedForwardPasses", "count", "forward passes run")
REAL_TOKENS = MetricSpec("EmbedRealTokens", "count", "tokens of the inputs")
PADDED_TOKENS = MetricSpec("EmbedPaddedTokens", "count", "tokens computed, padding included")
PREPARE_MS = MetricSpec("EmbedPrepareMs", "ms", "time parsing, validating and tokenizing")
MODEL_MS = MetricSpec("EmbedModelMs", "ms", "time in forward passes and pooling")
ENCODE_MS = MetricSpec("EmbedEncodeMs", "ms", "time normalizing, quantizing and serializing")
BATCH_SECONDS = MetricSpec("EmbedBatchSeconds", "s", "handler time per TorchServe batch", kind="histogram")
RESPONSES = MetricSpec("EmbedResponses", "count", "responses by HTTP status", ("Status",))
CACHE_HITS = MetricSpec("EmbedCacheHits", "count", "inputs answered from the cache, by tier (memory, redis)", ("Tier",))
CACHE_MISSES = MetricSpec("EmbedCacheMisses", "count", "inputs the cache did not hold")
CACHE_ERRORS = MetricSpec("EmbedCacheErrors", "count", "failed Redis calls; the batch was served uncached")

ALL = (BATCHES, REQUESTS, INPUTS, PASSES, REAL_TOKENS, PADDED_TOKENS, PREPARE_MS, MODEL_MS, ENCODE_MS,
       BATCH_SECONDS, RESPONSES, CACHE_HITS, CACHE_MISSES, CACHE_ERRORS)


def measurements(report: BatchReport) -> list[tuple[MetricSpec, float, tuple[str, ...]]]:
    """(metric, value, values of its own dimensions) for one batch."""
    rows = [
        (BATCHES, 1, ()),
        (REQUESTS, report.requests, ()),
        (INPUTS, report.inputs, ()),
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
