"""Builds served by a real TorchServe of their own, and closed-loop load runs against them.

Shared by the benchmark (bench/run.py), the packed-passes comparison (bench/packed.py) and the
CPU bf16 benchmark (bench/cpu_bf16.py), which all measure builds end to end the same way: a fresh
archive, a warmed-up server, and the target shapes run several times with the median run kept.
"""

from __future__ import annotations

import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from embedserve.archive.build import main as build_main
from bench.load import WARMUP_SECONDS, run_load, warm_up
from embedserve.scripts.serverctl import TorchServe, isolated_config

REPO = Path(__file__).resolve().parent.parent
# The shapes the targets are checked on, (clients, texts per request), are run REPEATS times
# and the median run is kept: the machine is shared, and single runs of one scenario differ
# by up to 15%.
TARGET_SHAPES = {(64, 1), (1, 1)}
REPEATS = 3


def server_cpu_seconds(server: TorchServe, workers: list[int] | None = None) -> tuple[float, float]:
    """The CPU seconds (user + system, the kernel's counters) TorchServe has used so far: its
    frontend (the JVM), and its workers: the processes `workers` names, else all of them."""
    import psutil

    frontend = psutil.Process(server.pid())
    processes = frontend.children(recursive=True) if workers is None else [psutil.Process(pid) for pid in workers]
    return sum(frontend.cpu_times()[:2]), sum(sum(process.cpu_times()[:2]) for process in processes)


def measured_runs(server: TorchServe, url: str, items: Sequence[Any], token_counts: Sequence[int], *, clients: int,
                  per_request: int, seconds: float, repeats: int, body: Callable[[list], Any]) -> list[dict]:
    """A 5 s warm-up, then `repeats` runs of the load, each run's summary with
    `server_cpu_ms_per_item`: the CPU of TorchServe's frontend and workers over the items sent."""
    run_load(url, server.auth(), items, token_counts, concurrency=clients, texts_per_request=per_request,
             seconds=5.0, body=body)  # warm
    runs = []
    for _ in range(repeats):
        cpu_before = sum(server_cpu_seconds(server))
        load = run_load(url, server.auth(), items, token_counts, concurrency=clients, texts_per_request=per_request,
                        seconds=seconds, body=body)
        result = load.summary()
        result["server_cpu_ms_per_item"] = (sum(server_cpu_seconds(server)) - cpu_before) * 1e3 / max(1, load.texts)
        runs.append(result)
    return runs


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput."""
    return sorted(runs, key=lambda run: run["texts_per_s"])[len(runs) // 2]


@contextmanager
def serve_model(model_dir: Path, name: str, what: str, build_args: tuple[str, ...] = (),
                properties: dict[str, str] | None = None) -> Iterator[TorchServe]:
    """A TorchServe of its own serving the default build of `model_dir` (`make serve`'s: no option
    but the model and its name, and `build_args`), ready; on a failed start, the ends of its logs
    first, since they go with the temporary folder. `properties` replace config.properties' own
    (default: asynchronous logging, as every benchmark runs; `{}`: `make serve`'s config as it is)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        root = Path(tmp)
        config = isolated_config(root, REPO / "config.properties",
                                 **({"async_logging": "true"} if properties is None else properties))
        if build_main(["--model", str(model_dir), "--name", name, "--export-path", str(root / "model_store"),
                       "--config", str(config), *build_args]) != 0:
            raise SystemExit(f"building {what} failed")
        server = TorchServe(config, root)
        server.start()
        try:
            try:
                server.wait_ready(timeout=600)
            except Exception:
                for log in ("torchserve.out", "ts_log.log", "model_log.log"):
                    path = server.logs / log
                    if path.is_file():
                        print(f"--- {log}:", *path.read_text(errors="replace").splitlines()[-40:], sep="\n",
                              file=sys.stderr)
                raise
            yield server
        finally:
            server.stop()


@contextmanager
def serve_build(dtype: str, corpora: dict, tokens: dict, concurrencies,
                settings: tuple[str, ...] | list[str] = (), timings: dict | None = None):
    """A TorchServe of its own serving a fresh `dtype` build: (predictions URL, auth). It is warmed
    up (bench/load.py) at each of the `concurrencies` it will be measured at that has a warm-up.
    `timings`, when given, gets the seconds the archive took to build (`build_s`) and from the
    server's start to its first embedding (`startup_s`): a worker that chooses its engine by
    measurement pays for the trial there."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        root = Path(tmp)
        config = isolated_config(root, REPO / "config.properties", async_logging="true")
        started = time.perf_counter()
        code = build_main(["--dtype", dtype, "--export-path", str(root / "model_store"), "--config", str(config),
                           *(arg for setting in settings for arg in ("--set", setting))])
        if code != 0:
            raise SystemExit(f"building the {dtype} archive failed")
        built = time.perf_counter()
        server = TorchServe(config, root)
        server.start()
        try:
            server.wait_ready(timeout=600)
            if timings is not None:
                timings.update(build_s=round(built - started, 1), startup_s=round(time.perf_counter() - built, 1))
            url = f"{server.url('inference')}/predictions/minilm"
            # The first seconds of a load run slower (the frontend's JIT, first-seen shapes);
            # no scenario should pay for that.
            warm_up(url, server.auth(), corpora["mixed"], tokens["mixed"],
                    seconds={c: s for c, s in WARMUP_SECONDS.items() if c in concurrencies})
            yield url, server.auth()
        finally:
            server.stop()


def end_to_end(dtype: str, corpora: dict, tokens: dict, scenarios, seconds: float,
               settings: tuple[str, ...] | list[str] = ()) -> list[dict]:
    """One server for all `scenarios` (corpus, clients, texts per request): a row for each, the
    median of REPEATS runs for the target shapes."""
    concurrencies = {concurrency for _, concurrency, _ in scenarios}
    with serve_build(dtype, corpora, tokens, concurrencies, settings) as (url, auth):
        return run_scenarios(" ".join([dtype, *settings]), url, auth, corpora, tokens, scenarios, seconds)


def run_scenarios(label: str, url: str, auth: dict, corpora: dict, tokens: dict, scenarios,
                  seconds: float) -> list[dict]:
    """end_to_end's runs against a server already up (serve_build), for callers that also ask
    it something else, such as its /info, on the same server."""
    rows = []
    for corpus, concurrency, per_request in scenarios:
        print(f"end to end {label}: {corpus}, {concurrency} clients, {per_request} texts/request ...",
              file=sys.stderr)
        runs = []
        for _ in range(REPEATS if (concurrency, per_request) in TARGET_SHAPES else 1):
            runs.append(run_load(url, auth, corpora[corpus], tokens[corpus], concurrency=concurrency,
                                 texts_per_request=per_request, seconds=seconds).summary())
            time.sleep(1.0)
        rows.append({"corpus": corpus, **_median_run(runs)})
    return rows


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput, and every run's throughput and p50 beside it."""
    median = sorted(runs, key=lambda r: r["texts_per_s"])[len(runs) // 2]
    if len(runs) == 1:
        return median
    return {**median, "runs_texts_per_s": [r["texts_per_s"] for r in runs], "runs_p50_ms": [r["p50_ms"] for r in runs]}
