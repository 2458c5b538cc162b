"""The shipped Prometheus scrape config and Grafana dashboard refer only to metrics that exist: the
ones the build's metrics config declares."""

import json
import re

import yaml

from embedserve.archive.metrics_config import metrics_config
from tests.support import REPO

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
