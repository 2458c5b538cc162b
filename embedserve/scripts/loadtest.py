"""Load test a server with Locust, starting it first when none answers.

    python -m embedserve.scripts.loadtest [--config config.properties] [--workdir .] [--users 16]
        [--spawn-rate 4] [--run-time 60] [--model NAME] [--tokenizer PATH] [--out bench/results]

What `make loadtest` runs. If the server of `--config` (keys in `--workdir`, as `make serve`
uses them) does not answer a real embedding request, this starts it, and stops it at the end;
a server that was already answering is left running. Locust (bench/locustfile.py) then runs
headless for --run-time seconds against the native, OpenAI and TEI routes and writes
<out>/loadtest_stats.csv (with _failures, _exceptions and _stats_history), <out>/loadtest.html
and its log, <out>/loadtest.log. The exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

from embedserve.scripts.serverctl import ServerError, TorchServe, default_version

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "bench" / "locustfile.py"
MAX_USERS = 1024
MAX_RUN_TIME_S = 3600
STOP_GRACE_S = 120  # corpus generation, ramp-up and report writing, on top of --run-time


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = TorchServe(args.config, args.workdir)
    started = False
    try:
        model = args.model or next(iter(server.models), None)
        if model not in server.models:
            raise ServerError(f"{args.config} does not serve {model or 'any model'}; run ./build_mar.sh first")
        if not server.embeds(model):
            if server.pid() is None:
                print(f"no server answers at {server.url('inference')}; starting one ...", file=sys.stderr)
                server.start()
                started = True
            server.wait_ready(args.timeout, progress=True)  # ours, or one still starting from this workdir
        return run_locust(server, model, args)
    except ServerError as err:
        print(f"loadtest: error: {err}", file=sys.stderr)
        return 1
    finally:
        if started:
            server.stop()
            print("stopped the server this load test started", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("config.properties"))
    parser.add_argument("--workdir", type=Path, default=Path("."), help="where the server keeps key_file.json")
    parser.add_argument("--model", default="", help="served model to load (default: the config's first)")
    parser.add_argument("--users", type=int, default=16, help="concurrent clients")
    parser.add_argument("--spawn-rate", type=float, default=4.0, help="clients started per second")
    parser.add_argument("--run-time", type=int, default=60, help="seconds of load")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json the texts are made from "
                                                        "(default: all-MiniLM-L6-v2's)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a server to be ready")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"no server configuration at {args.config}")
    if not 1 <= args.users <= MAX_USERS:
        parser.error(f"--users must be between 1 and {MAX_USERS}")
    if not 1 <= args.run_time <= MAX_RUN_TIME_S:
        parser.error(f"--run-time must be between 1 and {MAX_RUN_TIME_S} seconds")
    if args.spawn_rate <= 0:
        parser.error("--spawn-rate must be positive")
    return args


def run_locust(server: TorchServe, model: str, args: argparse.Namespace) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stats_csv, log = out / "loadtest_stats.csv", out / "loadtest.log"
    stats_csv.unlink(missing_ok=True)  # so a run that writes none is never summarized from an old one
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "--host", server.url("inference"), "--users", str(args.users), "--spawn-rate", str(args.spawn_rate),
        "--run-time", f"{args.run_time}s", "--csv", str(out / "loadtest"), "--html", str(out / "loadtest.html"),
        "--model", model, "--model-version", default_version(server.models[model]),
        "--key-file", str(server.workdir / "key_file.json"),
    ]
    if args.tokenizer:
        command += ["--tokenizer", str(args.tokenizer.resolve())]
    print(f"Locust: {args.users} users for {args.run_time} s against {server.url('inference')}/predictions/{model} "
          f"(log: {log}) ...", file=sys.stderr)
    try:
        # cwd: the locustfile imports embedserve.archive.corpus from the repository.
        with log.open("w") as log_file:
            locust = subprocess.run(command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                    timeout=args.run_time + STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        print(f"loadtest: error: Locust did not stop within {args.run_time + STOP_GRACE_S} s; see {log}",
              file=sys.stderr)
        return 1
    if not stats_csv.is_file():
        print(f"loadtest: error: Locust wrote no statistics (exit status {locust.returncode}):\n"
              f"{_tail(log)}", file=sys.stderr)
        return 1
    failures = print_summary(stats_csv, out / "loadtest_failures.csv")
    print(f"report: {out / 'loadtest.html'}; statistics: {out}/loadtest_*.csv")
    return 1 if failures or locust.returncode != 0 else 0


def print_summary(stats_csv: Path, failures_csv: Path) -> int:
    """Print requests, failures and latency per route and the commonest failures; return the failure count."""
    with stats_csv.open() as f:
        rows = list(csv.DictReader(f))
    print(f"{'request':<20} {'requests':>9} {'failures':>9} {'req/s':>7} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7}")
    for row in rows:
        print(f"{row['Name']:<20} {row['Request Count']:>9} {row['Failure Count']:>9} "
              f"{float(row['Requests/s']):>7.1f} {row['50%']:>7} {row['95%']:>7} {row['99%']:>7}")
    total = next((r for r in rows if r["Name"] == "Aggregated"), None)
    failed = int(total["Failure Count"]) if total else 0
    if failed and failures_csv.is_file():
        with failures_csv.open() as f:
            reasons = sorted(csv.DictReader(f), key=lambda r: -int(r["Occurrences"]))
        print("failures:")
        for reason in reasons[:5]:
            print(f"  {reason['Occurrences']:>6} x {reason['Name']}: {reason['Error']}")
    return failed


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main())
