"""Recovery from `kill -9` of model workers under load: what the requests get, and how long until
the model embeds again.

    python -m bench.recovery [--trials 3] [--model minilm | PATH] [--out bench/results]

On an isolated server built as `./build_mar.sh` builds (2 workers on CPU), a few clients send
one text each in a closed loop while, in each trial, one worker, then every worker, is killed
with SIGKILL. Per trial: the status of every request (in-flight ones get an error from
TorchServe; a request with no answer within the client timeout counts as unanswered), the time
from the kill to the first embedding answered to a request sent after the kill, and the time
until TorchServe reports every worker READY again on a new process. Results go to
`<out>/recovery.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from embedserve.archive.corpus import mixed_corpus
from bench.soak import build_isolated, embed_one
from embedserve.scripts.serverctl import TorchServe

REPO = Path(__file__).resolve().parent.parent
CLIENTS = 4
CLIENT_TIMEOUT_S = 60.0  # far above a worker restart: a request still open then was dropped
READY_TIMEOUT_S = 300.0


def model_workers(server: TorchServe, model: str) -> list[dict]:
    """TorchServe's view of the model's workers: id, pid, status (READY, ...), startTime."""
    import requests

    response = requests.get(f"{server.url('management')}/models/{model}", headers=server.auth("management"),
                            timeout=10)
    response.raise_for_status()
    return response.json()[0]["workers"]


def wait_replaced(server: TorchServe, model: str, killed: set[int], count: int, timeout: float) -> float:
    """Block until `count` workers are READY and none of them is a killed process; return the time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = model_workers(server, model)
        ready = [w for w in workers if w["status"] == "READY" and w["pid"] not in killed]
        if len(ready) >= count:
            return time.monotonic()
        time.sleep(0.1)
    raise TimeoutError(f"workers of {model} not READY again within {timeout:.0f} s")


@dataclass
class Call:
    sent: float  # time.monotonic()
    done: float
    status: int | str  # HTTP status, or the exception's name when no response came


async def trial(server: TorchServe, model: str, texts: Sequence[str], kill: int, warm_s: float = 3.0,
                after_s: float = 3.0) -> dict:
    """Kill `kill` workers with SIGKILL while CLIENTS closed-loop clients send, and time the recovery."""
    url = f"{server.url('inference')}/predictions/{model}"
    headers = server.auth()
    calls: list[Call] = []
    stop = asyncio.Event()

    async def client(session: aiohttp.ClientSession, offset: int) -> None:
        i = offset
        while not stop.is_set():
            sent = time.monotonic()
            status = await embed_one(session, url, headers, texts[i % len(texts)])
            calls.append(Call(sent, time.monotonic(), status))
            i += CLIENTS

    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.create_task(client(session, k)) for k in range(CLIENTS)]
        await asyncio.sleep(warm_s)
        before = await asyncio.to_thread(model_workers, server, model)
        victims = {w["pid"] for w in before[:kill]}
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        ready_at = await asyncio.to_thread(wait_replaced, server, model, victims, len(before), READY_TIMEOUT_S)
        after = await asyncio.to_thread(model_workers, server, model)
        await asyncio.sleep(after_s)
        stop.set()
        await asyncio.gather(*clients)

    first_ok = min((c.done for c in calls if c.sent >= killed_at and c.status == 200), default=None)
    return {
        "killed": len(victims),
        "workers": len(before),
        "killed_pids": sorted(victims),
        "new_pids": sorted(w["pid"] for w in after if w["pid"] not in {b["pid"] for b in before}),
        "worker_ids": sorted(w["id"] for w in after),
        "seconds_to_first_embedding": round(first_ok - killed_at, 2) if first_ok else None,
        "seconds_to_all_ready": round(ready_at - killed_at, 2),
        "all_requests": _count(calls),
        # Seconds from the kill: requests dispatched to a worker just before the frontend noticed
        # its death were sent a few milliseconds after the kill.
        "errors": [{"status": c.status, "sent_s": round(c.sent - killed_at, 3),
                    "answered_s": round(c.done - killed_at, 3)} for c in calls if c.status != 200],
        "unanswered": sum(1 for c in calls if not isinstance(c.status, int)),
        "max_latency_s": round(max(c.done - c.sent for c in calls), 2),
    }


def _count(calls: list[Call]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in calls:
        counts[str(c.status)] = counts.get(str(c.status), 0) + 1
    return counts


def summarize(trials: list[dict]) -> dict:
    out = {}
    for key in ("seconds_to_first_embedding", "seconds_to_all_ready"):
        values = [t[key] for t in trials if t[key] is not None]
        out[key] = {"median": round(statistics.median(values), 2), "max": max(values)} if values else None
    out["unanswered"] = sum(t["unanswered"] for t in trials)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recovery", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per scenario (one worker, every worker)")
    parser.add_argument("--model", default="minilm", help="minilm (the default model) or a local model folder")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)

    if args.model == "minilm":
        from embedserve.archive.default_model import fetch_default_model

        name, build_args, tokenizer_file = "minilm", [], fetch_default_model() / "tokenizer.json"
    else:
        folder = Path(args.model).resolve()
        name, build_args, tokenizer_file = "recovery", ["--model", str(folder), "--name", "recovery"], \
            folder / "tokenizer.json"
    texts = mixed_corpus(tokenizer_file, 512)

    scenarios: dict[str, list[dict]] = {"one_worker": [], "every_worker": []}
    with tempfile.TemporaryDirectory(prefix="recovery-") as tmp:
        server = build_isolated(Path(tmp), build_args)
        with server.running():
            workers = len(model_workers(server, name))
            for _ in range(args.trials):
                for scenario, kill in (("one_worker", 1), ("every_worker", workers)):
                    result = asyncio.run(trial(server, name, texts, kill))
                    print(f"{scenario}: {json.dumps(result)}", file=sys.stderr)
                    scenarios[scenario].append(result)
            model_entry = next(iter(server.models[name].values()))

    report = {
        "model": args.model,
        "server": {k: model_entry[k] for k in ("minWorkers", "batchSize", "maxBatchDelay", "responseTimeout")},
        "clients": CLIENTS,
        "client_timeout_s": CLIENT_TIMEOUT_S,
        "machine": {"cpu_count": os.cpu_count(), "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "summary": {scenario: summarize(trials) for scenario, trials in scenarios.items()},
        "trials": scenarios,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recovery.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {args.out / 'recovery.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
