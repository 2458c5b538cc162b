"""Host work against device work, simulated on a CPU: does a GPU worker's host work (parse,
tokenize, encode, TorchServe's own) overlap the device's passes?

    python -m bench.overlap [--delays 2,5,20] [--workers 1,2] [--clients 64] [--seconds 6] [--out DIR]

The real TorchServe serves the tiny random model (its pass nearly free) through a stand-in device:
every pass holds a lock the server's workers share, as one GPU serializes their passes, and
waits D ms there without using a CPU core, the way a host thread waits on a kernel
(EMBEDSERVE_TEST_FAULTS=device_pass_ms=D, tests/support/faults.py, through the tests' worker entry
tests/support/fault_entry.py). The build forces one pass per batch, so D is the device time of a
TorchServe batch.

H, the host time of a batch, is measured with a free device (D = 0) and one worker: b / texts/s,
b the mean batch the server formed (from its EmbedBatches and EmbedInputs metrics). Host and
device in series give b / (H + D) texts/s; perfect overlap b / max(H, D). `of_ideal` is the
measured texts/s over the latter, for each worker count: one worker cannot overlap (TorchServe
hands a worker its next batch only once it has answered the last), a second worker of the same
device computes while the first does host work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.load import run_load, warm_up
from bench.request_path import short_texts
from embedserve.archive.build import main as build_main
from embedserve.handler.worker.cpu_features import describe_cpu
from embedserve.scripts.serverctl import TorchServe, isolated_config
from tests.support.client import settled_metric_samples
from tests.support.faults import FAULTS_ENV
from tests.support.serving import with_fault_entry
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
# One pass per TorchServe batch: the planner never splits one (a pass "costs" a million tokens).
ONE_PASS_PER_BATCH = ("--set", "pass_overhead_tokens=1000000")


def measure(delays: list[int], workers: list[int], clients: int, seconds: float, cpu_threads: int = 1) -> dict:
    texts = short_texts()
    tokens = [len(text.split()) + 2 for text in texts]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "tiny")
        for count in workers:
            for delay in [0, *delays]:
                rows.append(_serve_and_load(root / f"w{count}-d{delay}", model, count, delay, clients, seconds,
                                            texts, tokens, cpu_threads))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return _judge(rows, delays, workers)


def _serve_and_load(root: Path, model: Path, workers: int, delay: int, clients: int, seconds: float,
                    texts: list[str], tokens: list[int], cpu_threads: int) -> dict:
    root.mkdir()
    config = isolated_config(root, REPO / "config.properties", async_logging="true")
    # cpu_threads: a GPU worker's torch computes nothing on the host; here the tiny pass takes one core at most.
    if build_main(["--model", str(model), "--name", "tiny", "--export-path", str(root / "model_store"),
                   "--config", str(config), "--workers", str(workers), "--skip-check",
                   "--set", f"cpu_threads={cpu_threads}", *ONE_PASS_PER_BATCH]) != 0:
        raise SystemExit("building the tiny archive failed")
    with_fault_entry(root / "model_store" / "tiny.mar")  # its workers run the stand-in device
    previous = os.environ.get(FAULTS_ENV)
    os.environ[FAULTS_ENV] = f"device_pass_ms={delay}"  # the workers inherit it from the frontend
    server = TorchServe(config, root)
    try:
        server.start()
        server.wait_ready(timeout=600)
        url = f"{server.url('inference')}/predictions/tiny"
        warm_up(url, server.auth(), texts, tokens, seconds={clients: 4.0})
        before = _counters(server)
        result = run_load(url, server.auth(), texts, tokens, concurrency=clients, texts_per_request=1,
                          seconds=seconds).summary()
        after = _counters(server)
    finally:
        server.stop()
        if previous is None:
            os.environ.pop(FAULTS_ENV, None)
        else:
            os.environ[FAULTS_ENV] = previous
    batches = after["EmbedBatches"] - before["EmbedBatches"]
    passes = after["EmbedForwardPasses"] - before["EmbedForwardPasses"]
    inputs = after["EmbedInputs"] - before["EmbedInputs"]
    return {"workers": workers, "device_ms": delay, "clients": clients, "texts_per_s": result["texts_per_s"],
            "p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"], "errors": result["errors"],
            "mean_batch": round(inputs / batches, 2) if batches else None,
            "passes_per_batch": round(passes / batches, 3) if batches else None}


def _counters(server: TorchServe) -> dict[str, float]:
    """The handler's counters, summed over every series (workers, tasks), once every worker has
    sent its last sums: a worker sends them at most every COUNTER_FLUSH_S, so a read during the
    load's tail could see one counter of a flush and not yet the next (passes/batch off by a flush)."""
    samples = settled_metric_samples(server, "tiny")
    return {name: sum(value for (sample, _), value in samples.items() if sample == name)
            for name in ("EmbedBatches", "EmbedForwardPasses", "EmbedInputs")}


def _judge(rows: list[dict], delays: list[int], workers: list[int]) -> dict:
    """H from the free-device run of one worker; each delayed run against b / max(H, D)."""
    free = next(r for r in rows if r["workers"] == min(workers) and r["device_ms"] == 0)
    batch = free["mean_batch"]
    host_ms = batch / free["texts_per_s"] * 1e3
    for row in rows:
        if row["device_ms"]:
            row["series_texts_per_s"] = round(batch / (host_ms + row["device_ms"]) * 1e3, 1)
            row["ideal_texts_per_s"] = round(batch / max(host_ms, row["device_ms"]) * 1e3, 1)
            row["of_ideal"] = round(row["texts_per_s"] / row["ideal_texts_per_s"], 3)
    return {"host_ms_per_batch": round(host_ms, 3), "host_us_per_text": round(host_ms / batch * 1e3, 1),
            "mean_batch": batch, "delays_ms": delays, "workers": workers, "runs": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="2,5,20", help="device ms per batch, comma-separated")
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", type=Path, default=None, help="write overlap.json here")
    args = parser.parse_args(argv)
    result = measure([int(d) for d in args.delays.split(",")], [int(w) for w in args.workers.split(",")],
                     args.clients, args.seconds)
    result["cpu"] = describe_cpu()
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overlap.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
