"""The per-request path: the project's handler on a near-free model against a handler that
computes nothing, in one TorchServe, at the same settings.

    python -m bench.request_path [--seconds 8] [--clients 64] [--set KEY=VALUE ...] [--out bench/results]

Both models get the default build's TorchServe settings (workers, batch size, delay). The
closed-loop client sends one short text per request; the tiny random BERT (hidden 32, 2 layers)
makes the forward pass nearly free, so what is left is the handler's own work per request and
TorchServe's. A third archive, the same tiny model built with `own_worker_loop=false`, keeps
TorchServe's Python worker loop, which the default build's workers leave after their first batch
(embedserve/handler/torchserve/wire.py). The three are measured in turns, REPEATS times each, and
the median run of each is kept: `ratio` is the handler's requests/s over the no-op handler's.

Throughput on a shared 2-core machine moves with whatever else runs; the CPU each request costs
moves less. Each run also reads the kernel's CPU counters (user + system) of the model's worker
processes and of the frontend around the load: `worker_cpu_us` and `frontend_cpu_us` a request.
The handler's own share is the project's workers' figure less the no-op's (`handler_cpu_us`, and
`handler_cpu_us_torchserve_loop` for the third archive): the no-op runs in TorchServe's loop, so
both pay TorchServe's JSON decoding of the body and its metrics, and the first also what the
worker's own loop saves or costs against TorchServe's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from embedserve.archive.build import main as build_main
from embedserve.archive.ts_config import read_properties, register_model
from embedserve.handler.worker.cpu_features import describe_cpu
from bench.load import WARMUP_SECONDS, run_load, warm_up
from bench.serving import server_cpu_seconds
from embedserve.scripts.serverctl import TorchServe, isolated_config
from tests.support.tiny_model import WORDS, make_tiny_model

REPO = Path(__file__).resolve().parent.parent
REPEATS = 3
TINY_DIMENSION = 32
# The tiny model served in TorchServe's own worker loop, beside the default build's.
TORCHSERVE_LOOP = "tinyts"


def short_texts(count: int = 512, words: int = 8) -> list[str]:
    """Texts of `words` words of the tiny model's vocabulary (about 10 tokens each)."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)) for i in range(count)]


def build_noop(config: Path, store: Path, settings: dict) -> None:
    """Pack bench/noop_handler.py with the same TorchServe settings and register it."""
    with tempfile.TemporaryDirectory() as tmp:
        model_config = Path(tmp) / "model-config.yaml"
        model_config.write_text(yaml.safe_dump({**settings, "handler": {"dimension": TINY_DIMENSION}}))
        archiver = Path(sys.executable).parent / "torch-model-archiver"
        subprocess.run([str(archiver if archiver.exists() else shutil.which("torch-model-archiver")),
                        "--model-name", "noop", "--version", "1.0", "--handler", str(REPO / "bench" / "noop_handler.py"),
                        "--config-file", str(model_config), "--export-path", str(store), "--force"], check=True)
    register_model(config, "noop", "1.0", {"defaultVersion": True, "marName": "noop.mar", **settings})


def measure(seconds: float, clients: int, build_args: tuple[str, ...] = ()) -> dict:
    texts = short_texts()
    tokens = [len(text.split()) + 2 for text in texts]
    with tempfile.TemporaryDirectory(prefix="bench-path-") as tmp:
        root = Path(tmp)
        config = isolated_config(root, REPO / "config.properties", async_logging="true")
        model = make_tiny_model(root / "tiny")
        store = root / "model_store"
        if build_main(["--model", str(model), "--name", "tiny", "--export-path", str(store), "--config", str(config),
                       *build_args]) != 0:
            raise SystemExit("building the tiny archive failed")
        if build_main(["--model", str(model), "--name", TORCHSERVE_LOOP, "--export-path", str(store), "--config",
                       str(config), *build_args, "--set", "own_worker_loop=false"]) != 0:
            raise SystemExit("building the tiny archive on TorchServe's loop failed")
        settings = _entry(config, "tiny")
        build_noop(config, store, settings)
        server = TorchServe(config, root)
        server.start()
        try:
            server.wait_ready(timeout=600)
            urls = {name: f"{server.url('inference')}/predictions/{name}"
                    for name in ("tiny", TORCHSERVE_LOOP, "noop")}
            for url in urls.values():  # the frontend's JIT and the workers' first batches
                warm_up(url, server.auth(), texts, tokens, seconds={clients: WARMUP_SECONDS[64]})
            runs: dict[str, list[dict]] = {name: [] for name in urls}
            for _ in range(REPEATS):
                for name, url in urls.items():
                    runs[name].append(measured_run(server, name, url, texts, tokens, clients, seconds))
                    time.sleep(0.5)
        finally:
            server.stop()
    result = {"settings": settings, "clients": clients}
    for name, name_runs in runs.items():
        median = sorted(name_runs, key=lambda r: r["texts_per_s"])[len(name_runs) // 2]
        result[name] = {"requests_per_s": median["texts_per_s"], "p50_ms": median["p50_ms"],
                        "p99_ms": median["p99_ms"], "errors": median["errors"],
                        "runs_requests_per_s": [r["texts_per_s"] for r in name_runs],
                        # CPU a request: the median over the runs, each counter on its own.
                        **{key: statistics.median_low([r[key] for r in name_runs]) for key in ("worker_cpu_us", "frontend_cpu_us")}}
    result["ratio"] = round(result["tiny"]["requests_per_s"] / result["noop"]["requests_per_s"], 3)
    result["handler_cpu_us"] = round(result["tiny"]["worker_cpu_us"] - result["noop"]["worker_cpu_us"], 1)
    result["handler_cpu_us_torchserve_loop"] = round(
        result[TORCHSERVE_LOOP]["worker_cpu_us"] - result["noop"]["worker_cpu_us"], 1)
    result["cpu"] = describe_cpu()
    return result


def measured_run(server: TorchServe, model: str, url: str, texts: list[str], tokens: list[int], clients: int,
                 seconds: float) -> dict:
    """One run of one-text requests to `model`: the load's summary, and the CPU a request of the
    model's workers and of the frontend, from the kernel's counters around it."""
    workers = worker_pids(server, model)
    before = server_cpu_seconds(server, workers)
    load = run_load(url, server.auth(), texts, tokens, concurrency=clients, texts_per_request=1, seconds=seconds,
                    warmup_seconds=0.0)
    frontend, worker = (end - start for end, start in zip(server_cpu_seconds(server, workers), before))
    # Every request the counters saw: the counted, the failed, and one a client before them.
    served = load.requests + sum(load.errors.values()) + clients
    return {**load.summary(), "worker_cpu_us": round(worker / served * 1e6, 1),
            "frontend_cpu_us": round(frontend / served * 1e6, 1)}


def worker_pids(server: TorchServe, model: str) -> list[int]:
    """The process ids of `model`'s workers, from TorchServe's management API."""
    request = urllib.request.Request(f"{server.url('management')}/models/{model}", headers=server.auth("management"))
    with urllib.request.urlopen(request, timeout=30) as response:
        described = json.load(response)
    return [worker["pid"] for version in described for worker in version["workers"]]


def _entry(config: Path, name: str) -> dict:
    """The TorchServe settings the build registered for `name`."""
    versions = json.loads(read_properties(config)["models"])[name]
    entry = next(iter(versions.values()))
    return {key: entry[key] for key in ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout",
                                        "startupTimeout")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.request_path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a handler setting of the project's archive, as ./build_mar.sh --set takes it")
    parser.add_argument("--out", type=Path, default=None, help="write request_path.json here")
    args = parser.parse_args(argv)
    result = measure(args.seconds, args.clients, tuple(arg for setting in args.settings for arg in ("--set", setting)))
    result["handler_settings"] = args.settings
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "request_path.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
