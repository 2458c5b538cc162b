"""Calling a real TorchServe as users do: requests sent at the same moment (so TorchServe batches
them together), the vectors of an answer, and the handler's metrics from the Prometheus endpoint."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests

from embedserve.handler.worker.metrics import COUNTER_FLUSH_S


def predict(server, body, model="tiny", path="", content_type="application/json", headers=None):
    url = f"{server.url('inference')}/predictions/{model}" + (f"/1.0/{path}" if path else "")
    data = json.dumps(body).encode() if not isinstance(body, (bytes, str)) else body
    return requests.post(url, data=data, timeout=60,
                         headers={"Content-Type": content_type, **server.auth(), **(headers or {})})


def concurrently(calls):
    """Run the calls at the same moment, so TorchServe batches them together."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def vectors(response):
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]])


def metric_samples(server, model="tiny") -> dict[tuple[str, str], float]:
    """(metric name, labels) -> value of the handler's metrics for `model`, from the Prometheus endpoint."""
    samples = {}
    for line in requests.get(f"{server.url('metrics')}/metrics", timeout=30).text.splitlines():
        if line.startswith("Embed") and f'ModelName="{model}"' in line:
            name_labels, value = line.rsplit(" ", 1)
            name, labels = name_labels.split("{", 1)
            samples[(name, labels)] = float(value)
    return samples


def settled_metric_samples(server, model="tiny") -> dict[tuple[str, str], float]:
    """The samples once the counters of earlier requests have arrived: two reads a flush apart
    agree (a busy machine can hold a previous test's counters past its end)."""
    samples, deadline = metric_samples(server, model), time.monotonic() + 10
    while True:
        time.sleep(COUNTER_FLUSH_S + 0.2)
        again = metric_samples(server, model)
        if again == samples or time.monotonic() > deadline:
            return again
        samples = again


def metric_samples_after(server, before, requests, model="tiny"):
    """The samples once the counters show `requests` more requests: counters arrive summed, at
    most COUNTER_FLUSH_S after their batch (embedserve/handler/worker/metrics.py)."""
    deadline = time.monotonic() + 10
    while True:
        time.sleep(COUNTER_FLUSH_S + 0.2)
        after = metric_samples(server, model)
        counted = sum(v for (name, _), v in after.items() if name == "EmbedRequests") \
            - sum(v for (name, _), v in before.items() if name == "EmbedRequests")
        if counted >= requests or time.monotonic() > deadline:
            return after


def metric_growth(before, after, name, label=""):
    """How much the samples of `name` whose labels contain `label` grew."""
    keys = [k for k in after if k[0] == name and label in k[1]]
    assert keys, f"{name} missing from /metrics"
    return sum(after[k] - before.get(k, 0.0) for k in keys)


def worker_identities(server, model: str) -> set[tuple]:
    """(pid, start time) of each of the model's workers: unchanged while no worker died."""
    [described] = requests.get(f"{server.url('management')}/models/{model}", headers=server.auth("management"),
                               timeout=30).json()
    return {(worker["pid"], worker["startTime"]) for worker in described["workers"]}
