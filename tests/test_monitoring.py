"""The shipped Prometheus scrape config and Grafana dashboard refer only to metrics that exist, and
the handler sends each of its series from the first batch that measures it."""

import json
import re

import yaml

from archive.metrics_config import metrics_config
from tests.conftest import REPO

QUERY_FUNCTIONS = {"sum", "by", "rate", "histogram_quantile", "ignoring", "group_left"}
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def declared_metrics() -> set[str]:
    config = metrics_config()
    return {entry["name"] for section in ("ts_metrics", "model_metrics")
            for entries in config[section].values() for entry in entries}


def test_dashboard_queries_only_declared_metrics():
    dashboard = json.loads((REPO / "deploy" / "grafana" / "dashboard.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(expressions) >= 6
    used = set()
    for expression in expressions:
        without_labels = re.sub(r"\([A-Za-z_, ]*\)|\{[^}]*\}|\[[^\]]*\]", " ", expression)
        names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", without_labels)) - QUERY_FUNCTIONS
        used |= {HISTOGRAM_SERIES.sub("", name) if name.startswith("Embed") else name for name in names}
    assert used and used <= declared_metrics(), used - declared_metrics()
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("throughput", "latency percentiles", "batch fill", "padding efficiency", "status",
                  "cache hit ratio"):
        assert topic in titles


def test_scrape_config_targets_the_metrics_address():
    scrape = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    [job] = scrape["scrape_configs"]
    metrics_port = re.search(r"metrics_address=http://127.0.0.1:(\d+)", (REPO / "config.properties").read_text())[1]
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{metrics_port}"]


def test_a_zero_counter_is_sent_once_so_its_series_exists():
    from handler.metrics import ALL, BatchReport
    from handler.ts_handler import _record

    class Metrics:
        def __init__(self):
            self.lines = []

        def add_metric(self, name, value, unit, dimensions, metric_type):
            self.lines.append((name, value, tuple(d.value for d in dimensions)))

    context = type("Context", (), {"metrics": Metrics()})()
    emitted = set()
    _record(context, BatchReport(requests=2, statuses={400: 2}, cache_enabled=True), emitted)
    assert {name for name, _, _ in context.metrics.lines} == {spec.name for spec in ALL}  # zeros included
    context.metrics.lines.clear()
    _record(context, BatchReport(requests=1, inputs=1, forward_passes=1, real_tokens=3, padded_tokens=3,
                                 model_ms=1.0, statuses={200: 1}, cache_enabled=True, cache_misses=1), emitted)
    sent = {name: value for name, value, _ in context.metrics.lines}
    assert sent == {"EmbedBatches": 1, "EmbedRequests": 1, "EmbedInputs": 1, "EmbedForwardPasses": 1,
                    "EmbedRealTokens": 3, "EmbedPaddedTokens": 3, "EmbedModelMs": 1.0, "EmbedBatchSeconds": 0.001,
                    "EmbedResponses": 1, "EmbedCacheMisses": 1}
    assert ("EmbedResponses", 1, ("200",)) in context.metrics.lines  # a status' first batch is sent
