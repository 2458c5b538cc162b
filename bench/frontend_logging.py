"""The frontend's CPU a request under three log configurations, side by side: TorchServe's own,
the project's (embedserve/scripts/log4j2.xml, what serverctl starts TorchServe with), and the
project's with the access log off.

    python -m bench.frontend_logging [--seconds 8] [--repeats 7] [--clients 64] [--out DIR]

Three servers, each the tiny random BERT built with the default build's settings and the
repository's config.properties (no async_logging: what `make serve` runs), are up together and
measured in turns, one text a request from `clients` closed-loop clients. Each run reads the
kernel's CPU counters of the frontend (the JVM) and of the workers around the load. The median
over the runs of each is kept; `frontend_ratio` is each configuration's frontend CPU a request over
TorchServe's own. Writes DIR/frontend_logging.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.load import run_load
from bench.request_path import measured_run, short_texts
from embedserve.archive.build import main as build_main
from embedserve.handler.worker.cpu_features import describe_cpu
from embedserve.scripts.serverctl import LOG_CONFIG, TorchServe, isolated_config
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
# The frontend's JIT compiler takes about a fifth of its CPU in a load shape's first 10 s, and
# little after 20 s (docs/performance.md): warm each server past that.
WARM_SECONDS = 30.0


def without_access_log(folder: Path) -> Path:
    """The project's configuration with ACCESS_LOG's level off."""
    text = LOG_CONFIG.read_text()
    marked = '<Logger name="ACCESS_LOG" level="info"'
    if marked not in text:
        raise SystemExit(f"{LOG_CONFIG} no longer has {marked!r}")
    path = folder / "log4j2-no-access-log.xml"
    path.write_text(text.replace(marked, '<Logger name="ACCESS_LOG" level="off"'))
    return path


def measure(seconds: float, repeats: int, clients: int) -> dict:
    texts = short_texts()
    tokens = [len(text.split()) + 2 for text in texts]
    with tempfile.TemporaryDirectory(prefix="bench-frontend-logging-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "tiny")
        log_configs = {"torchserve": None, "project": LOG_CONFIG, "project_no_access_log": without_access_log(root)}
        servers: dict[str, TorchServe] = {}
        try:
            for name, log_config in log_configs.items():
                work = root / name
                work.mkdir()
                config = isolated_config(work, REPO / "config.properties")
                if build_main(["--model", str(model), "--name", "tiny", "--export-path", str(work / "model_store"),
                               "--config", str(config)]) != 0:
                    raise SystemExit("building the tiny archive failed")
                servers[name] = TorchServe(config, work, log_config=log_config)
                servers[name].start()
            for server in servers.values():
                server.wait_ready(timeout=600)
            urls = {name: f"{server.url('inference')}/predictions/tiny" for name, server in servers.items()}
            for name, server in servers.items():
                run_load(urls[name], server.auth(), texts, tokens, concurrency=clients, texts_per_request=1,
                         seconds=WARM_SECONDS)
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for _ in range(repeats):
                for name, server in servers.items():
                    run = measured_run(server, "tiny", urls[name], texts, tokens, clients, seconds)
                    runs[name].append({"requests_per_s": run["texts_per_s"], "errors": run["errors"],
                                       **{key: run[key] for key in ("frontend_cpu_us", "worker_cpu_us")}})
                    print(name, runs[name][-1], file=sys.stderr, flush=True)
                    time.sleep(0.5)
        finally:
            for server in servers.values():
                server.stop()
    result: dict = {"clients": clients, "seconds": seconds, "repeats": repeats, "cpu": describe_cpu()}
    for name, name_runs in runs.items():
        result[name] = {key: statistics.median(run[key] for run in name_runs)
                        for key in ("requests_per_s", "frontend_cpu_us", "worker_cpu_us")}
        result[name]["runs"] = name_runs
    for name in servers:
        result[name]["frontend_ratio"] = round(result[name]["frontend_cpu_us"] / result["torchserve"]["frontend_cpu_us"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.frontend_logging", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write frontend_logging.json here")
    args = parser.parse_args(argv)
    result = measure(args.seconds, args.repeats, args.clients)
    print(json.dumps({name: value for name, value in result.items() if name != "cpu"}, indent=2, default=str))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "frontend_logging.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
