"""Soak: hold the real TorchServe at about 70% of its measured capacity and watch its memory.

    python -m bench.soak [--minutes 10] [--model minilm | PATH] [--out bench/results]

1. Build the model (the default all-MiniLM-L6-v2, or a local model folder) into a temporary
   folder and start an isolated server on free ports.
2. Measure capacity briefly: a closed loop of many clients (bench/load.py), one text a request.
3. Send requests open-loop at a fixed rate of `--load` (0.7) times that capacity for the set
   time, and sample every few seconds the resident memory (VmRSS) of the frontend JVM and of
   each worker process.
4. Growth after warm-up: the median RSS of the first window after warm-up against the median of
   the last window, per process; more than `--limit` percent fails. Beside it, the growth over
   the second half tells a leak (grows in both halves) from a high-water mark (levels off).
Results go to `<out>/soak.json` and `<out>/soak.png` (`soak-<label>.*` with `--label`). The
server inherits this process's environment (allocator settings such as MALLOC_MMAP_THRESHOLD_
reach the workers), and the load generator runs on the same cores as the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from embedserve.archive.build import main as build_main
from embedserve.archive.corpus import load_tokenizer, mixed_corpus
from embedserve.archive.ts_config import update_properties
from bench.load import run_load
from embedserve.scripts.serverctl import ServerError, TorchServe, isolated_config

REPO = Path(__file__).resolve().parent.parent
CAPACITY_CLIENTS = 32  # enough to keep every batch full: the throughput the server can give
CLIENT_TIMEOUT_S = 120.0  # the build's response timeout: a request past it counts as unanswered


# --- processes and their memory -----------------------------------------------------------

def rss_kib(pid: int) -> int | None:
    """Resident memory of a process in KiB, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def worker_pids(frontend_pid: int) -> list[int]:
    """The model worker processes: the frontend's children running TorchServe's worker script."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name in /proc/<pid>/stat may hold spaces and parentheses: split after the last ')'.
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == frontend_pid and b"model_service_worker" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return sorted(found)


@dataclass
class MemorySampler:
    """RSS of the frontend and of every worker, in KiB, each time `sample` is called."""

    frontend_pid: int
    started: float = field(default_factory=time.monotonic)
    samples: list[dict] = field(default_factory=list)

    def sample(self) -> None:
        row = {"t": round(time.monotonic() - self.started, 2), "rss_kib": {}}
        processes = [("frontend", self.frontend_pid)] + [(f"worker {p}", p) for p in worker_pids(self.frontend_pid)]
        for name, pid in processes:
            rss = rss_kib(pid)
            if rss is not None:
                row["rss_kib"][name] = rss
        self.samples.append(row)

    def series(self) -> dict[str, list[tuple[float, int]]]:
        out: dict[str, list[tuple[float, int]]] = {}
        for row in self.samples:
            for name, rss in row["rss_kib"].items():
                out.setdefault(name, []).append((row["t"], rss))
        return out


def rss_growth(series: dict[str, list[tuple[float, int]]], warmup_s: float, window_s: float,
               end_s: float) -> dict[str, dict]:
    """Per process: median RSS (MiB) of the first window after warm-up, [warmup, warmup + window),
    against the last, [end - window, end]: `growth_pct`, the figure held to the limit. Beside it,
    `late_growth_pct` compares the window starting halfway through with the last one: a leak grows
    in both halves, a high-water mark reached once (the allocator keeping the largest batch's
    memory) does not. A process missing from a window (a worker that died and was replaced) is
    reported without figures."""
    middle_s = (warmup_s + end_s) / 2

    def median_in(points, start, stop):
        inside = [rss for t, rss in points if start <= t <= stop]
        return statistics.median(inside) if inside else None

    report = {}
    for name, points in series.items():
        first = median_in(points, warmup_s, warmup_s + window_s)
        middle = median_in(points, middle_s, middle_s + window_s)
        last = median_in(points, end_s - window_s, end_s)
        if first is None or last is None:
            report[name] = {"growth_pct": None, "note": "not alive in both windows (restarted?)"}
            continue
        report[name] = {"first_mib": round(first / 1024, 1), "last_mib": round(last / 1024, 1),
                        "growth_pct": round(100 * (last - first) / first, 2),
                        "late_growth_pct": round(100 * (last - middle) / middle, 2) if middle else None}
    return report


# --- servers ------------------------------------------------------------------------------

def build_isolated(root: Path, build_args: Sequence[str], **properties: str) -> TorchServe:
    """Build a model into its own config on free ports under `root`. `properties` are set after
    the build, which rewrites `job_queue_size`, so they win."""
    config = isolated_config(root, REPO / "config.properties", async_logging="true")
    if build_main([*build_args, "--export-path", str(root / "model_store"), "--config", str(config)]) != 0:
        raise SystemExit(f"building {' '.join(build_args) or 'the default model'} failed")
    if properties:
        update_properties(config, properties)
    return TorchServe(config, root)


# --- load ---------------------------------------------------------------------------------

@dataclass
class Answer:
    sent_at: float  # seconds from the start of the load
    latency_s: float
    status: int | str  # HTTP status, or the exception's name when no response came


async def embed_one(session: aiohttp.ClientSession, url: str, headers: dict[str, str], text: str) -> int | str:
    """The HTTP status of one one-text request ("wrong embedding count" for a bad 200), or the
    exception's name when no response came."""
    try:
        async with session.post(url, json={"input": [text]}, headers=headers) as response:
            body = await response.read()
            if response.status == 200 and len(json.loads(body)["data"]) != 1:
                return "wrong embedding count"
            return response.status
    except (TimeoutError, aiohttp.ClientError) as err:
        return type(err).__name__


async def open_loop(url: str, headers: dict[str, str], texts: Sequence[str], rate: float, seconds: float,
                    on_tick=None, tick_s: float = 5.0) -> list[Answer]:
    """Send one text per request at a fixed rate, whatever the server does (open loop: a slow
    server does not slow the arrivals), and await every request sent. `on_tick` is called every
    `tick_s` seconds meanwhile."""
    answers: list[Answer] = []
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def send(session: aiohttp.ClientSession, text: str) -> None:
        sent = loop.time()
        status = await embed_one(session, url, headers, text)
        answers.append(Answer(sent - started, loop.time() - sent, status))

    async def ticker() -> None:
        while True:
            on_tick()
            await asyncio.sleep(tick_s)

    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        ticking = asyncio.create_task(ticker()) if on_tick else None
        pending = set()
        count = int(rate * seconds)
        for i in range(count):
            await asyncio.sleep(max(0.0, started + i / rate - loop.time()))
            task = asyncio.create_task(send(session, texts[i % len(texts)]))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
        if ticking:
            ticking.cancel()
            on_tick()  # one last sample at the end
    return answers


def answer_summary(answers: list[Answer]) -> dict:
    by_status: dict[str, int] = {}
    for a in answers:
        by_status[str(a.status)] = by_status.get(str(a.status), 0) + 1
    ok = np.array([a.latency_s * 1000 for a in answers if a.status == 200]) if answers else np.array([])
    percentiles = {f"p{p}_ms": round(float(np.percentile(ok, p)), 1) if ok.size else None for p in (50, 99)}
    return {"sent": len(answers), "by_status": by_status, **percentiles,
            "max_ms": round(max(a.latency_s for a in answers) * 1000, 1) if answers else None}


def windows(answers: list[Answer], width_s: float) -> list[dict]:
    """Throughput and latency per window of send time, to see drift beside the memory."""
    rows = []
    end = max((a.sent_at for a in answers), default=0.0)
    start = 0.0
    while start <= end:
        inside = [a for a in answers if start <= a.sent_at < start + width_s]
        ok = [a.latency_s * 1000 for a in inside if a.status == 200]
        rows.append({"t": start, "ok_per_s": round(len(ok) / width_s, 1), "errors": len(inside) - len(ok),
                     "p50_ms": round(float(np.percentile(ok, 50)), 1) if ok else None,
                     "p99_ms": round(float(np.percentile(ok, 99)), 1) if ok else None})
        start += width_s
    return rows


# --- the soak -----------------------------------------------------------------------------

def measure_capacity(server: TorchServe, model: str, texts: Sequence[str], token_counts: Sequence[int],
                     seconds: float) -> dict:
    """Requests/s the server answers with every batch full (one text a request)."""
    url = f"{server.url('inference')}/predictions/{model}"
    result = run_load(url, server.auth(), texts, token_counts, concurrency=CAPACITY_CLIENTS,
                      texts_per_request=1, seconds=seconds, warmup_seconds=min(5.0, seconds / 2))
    summary = result.summary()
    summary["requests_per_s"] = round(result.requests / result.seconds, 1)
    return summary


def soak(server: TorchServe, model: str, texts: Sequence[str], *, rate: float, seconds: float, warmup_s: float,
         window_s: float, sample_s: float) -> dict:
    """Load the server open-loop at `rate` requests/s for `seconds`, sampling RSS every `sample_s`."""
    pid = server.pid()
    if pid is None:
        raise ServerError("the server is not running")
    sampler = MemorySampler(pid)
    url = f"{server.url('inference')}/predictions/{model}"
    answers = asyncio.run(open_loop(url, server.auth(), texts, rate, seconds, on_tick=sampler.sample, tick_s=sample_s))
    end_s = sampler.samples[-1]["t"]
    return {
        "rate_per_s": round(rate, 2),
        "seconds": seconds,
        "warmup_s": warmup_s,
        "window_s": window_s,
        "requests": answer_summary(answers),
        "windows": windows(answers, window_s),
        "growth": rss_growth(sampler.series(), warmup_s, window_s, end_s),
        "samples": sampler.samples,
    }


def verdict(growth: dict[str, dict], limit_pct: float) -> bool:
    figures = [g["growth_pct"] for g in growth.values() if g["growth_pct"] is not None]
    return bool(figures) and all(f < limit_pct for f in figures)


def plot(result: dict, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, int]]] = {}
    for row in result["soak"]["samples"]:
        for name, rss in row["rss_kib"].items():
            series.setdefault(name, []).append((row["t"], rss))
    figure, (memory, load) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, points in sorted(series.items()):
        growth = result["soak"]["growth"][name]
        label = name if growth["growth_pct"] is None else (f"{name} ({growth['growth_pct']:+.1f}% after warm-up, "
                                                          f"{growth['late_growth_pct']:+.1f}% in the second half)")
        memory.plot([t / 60 for t, _ in points], [rss / 1024 for _, rss in points], label=label)
    warmup_min = result["soak"]["warmup_s"] / 60
    for axis in (memory, load):
        axis.axvspan(0, warmup_min, color="grey", alpha=0.15, label="warm-up" if axis is memory else None)
        axis.grid(True, alpha=0.3)
    memory.set_ylabel("RSS (MiB)")
    memory.set_title(f"{result['model']} soak at {result['soak']['rate_per_s']} requests/s "
                     f"({result['load_fraction']:.0%} of capacity): resident memory")
    memory.legend(fontsize=8)
    rows = result["soak"]["windows"]
    x = [r["t"] / 60 for r in rows]
    load.plot(x, [r["ok_per_s"] for r in rows], marker=".", label="answered 200 per s")
    load.set_ylabel("requests/s")
    latency = load.twinx()
    latency.plot(x, [r["p99_ms"] for r in rows], color="tab:red", marker=".", label="p99 latency")
    latency.set_ylabel("p99 latency (ms)", color="tab:red")
    load.set_xlabel("minutes")
    load.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(output, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the soak")
    parser.add_argument("--model", default="minilm", help="minilm (the default model) or a local model folder")
    parser.add_argument("--workers", type=int, default=0, help="workers (0: the build's default)")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity to send")
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--window-minutes", type=float, default=1.0, help="window compared at each end")
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--limit", type=float, default=5.0, help="largest RSS growth after warm-up, percent")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--label", default="", help="written to soak-<label>.json/.png instead of soak.json/.png")
    args = parser.parse_args(argv)
    if args.minutes * 60 < (args.warmup_minutes + 2 * args.window_minutes) * 60:
        parser.error("--minutes must cover the warm-up and two windows")

    if args.model == "minilm":
        from embedserve.archive.default_model import fetch_default_model

        name, build_args, tokenizer_file = "minilm", [], fetch_default_model() / "tokenizer.json"
    else:
        folder = Path(args.model).resolve()
        name, build_args, tokenizer_file = "soak", ["--model", str(folder), "--name", "soak"], folder / "tokenizer.json"
    if args.workers:
        build_args += ["--workers", str(args.workers)]
    texts = mixed_corpus(tokenizer_file, 2048)
    tokenizer = load_tokenizer(tokenizer_file)
    token_counts = [len(tokenizer.encode(t).ids) for t in texts]

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        server = build_isolated(Path(tmp), build_args)
        with server.running():
            print("measuring capacity ...", file=sys.stderr)
            capacity = measure_capacity(server, name, texts, token_counts, args.capacity_seconds)
            rate = args.load * capacity["requests_per_s"]
            print(f"capacity {capacity['requests_per_s']} requests/s; soaking at {rate:.1f}/s for "
                  f"{args.minutes} min ...", file=sys.stderr)
            load_before = os.getloadavg()
            result = soak(server, name, texts, rate=rate, seconds=args.minutes * 60,
                          warmup_s=args.warmup_minutes * 60, window_s=args.window_minutes * 60,
                          sample_s=args.sample_seconds)
            model_entry = next(iter(server.models[name].values()))

    passed = verdict(result["growth"], args.limit)
    report = {
        "model": args.model,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "server": {k: model_entry[k] for k in ("minWorkers", "batchSize", "maxBatchDelay")},
        "capacity": capacity,
        "load_fraction": args.load,
        # The server inherits this process's environment: glibc malloc tuning changes worker RSS.
        "malloc_environment": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "limit_pct": args.limit,
        "passed": passed,
        "soak": result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"soak-{args.label}" if args.label else "soak"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / f"{stem}.png")
    print(json.dumps({"requests": result["requests"], "growth": result["growth"], "passed": passed}, indent=2))
    print(f"wrote {args.out / stem}.json and .png", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
