"""What the load generator costs the machine it shares with the server: bench/load.py's client
against aiohttp's, the client it replaced, in turns against one server.

    python -m bench.load_client [--seconds 5] [--repeats 3] [--out DIR]

The server is the tiny random BERT built with the default build's settings and the repository's
config.properties, so the model costs almost nothing and the client's share shows. Each run is 64
closed-loop clients of one text or of 32 texts a request, with asyncio's own event loop and with
uvloop where it is installed. A run reads its own process's CPU time (the client's: the server
runs in other processes) over the requests it sent. The median run of each client is kept;
`ratios` are this generator's figures over aiohttp's. Writes DIR/load_client.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.load import run_load, warm_up
from bench.request_path import short_texts
from embedserve.archive.build import main as build_main
from embedserve.handler.worker.cpu_features import describe_cpu
from embedserve.scripts.serverctl import TorchServe, isolated_config
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
CLIENTS = 64
SHAPES = (1, 32)  # texts a request


async def _aiohttp_load(url: str, headers: dict, batches: list[list[str]], clients: int, seconds: float) -> dict:
    """The closed loop bench/load.py ran before, on aiohttp: a session, a connection a client,
    each request's JSON encoded as it is sent."""
    turn = iter(range(10**12))
    answered, errors = [0], [0]

    async def client(session: aiohttp.ClientSession, until: float) -> None:
        while True:
            batch = batches[next(turn) % len(batches)]
            async with session.post(url, json={"input": batch}, headers=headers) as response:
                await response.read()
                answered[0] += response.status == 200  # as run_load counts: a 200, or an error
                errors[0] += response.status != 200
            if time.perf_counter() >= until:
                return

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session, started + seconds) for _ in range(clients)))
        return {"requests": answered[0], "errors": errors[0], "seconds": time.perf_counter() - started}


def one_run(client: str, loop: str, url: str, headers: dict, texts: list[str], per: int, seconds: float) -> dict:
    if loop == "uvloop":
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(None)
    cpu = time.process_time()
    if client == "aiohttp":
        batches = [texts[i : i + per] for i in range(0, len(texts) - per + 1, per)]
        done = asyncio.run(_aiohttp_load(url, headers, batches, CLIENTS, seconds))
    else:
        result = run_load(url, headers, texts, [1] * len(texts), concurrency=CLIENTS, texts_per_request=per,
                          seconds=seconds, warmup_seconds=0.0)
        done = {"requests": result.requests, "errors": sum(result.errors.values()), "seconds": result.seconds}
    cpu = time.process_time() - cpu
    # run_load also sends one uncounted request a client before its measured phase.
    sent = done["requests"] + done["errors"] + (CLIENTS if client != "aiohttp" else 0)
    return {"requests_per_s": round(done["requests"] / done["seconds"], 1),
            "texts_per_s": round(done["requests"] * per / done["seconds"], 1),
            "client_cpu_us": round(cpu / max(1, sent) * 1e6, 1), "errors": done["errors"]}


def measure(seconds: float, repeats: int) -> dict:
    texts = short_texts()
    loops = ["asyncio"]
    try:
        import uvloop  # noqa: F401
        loops.append("uvloop")
    except ImportError:
        pass
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-load-client-") as tmp:
        root = Path(tmp)
        config = isolated_config(root, REPO / "config.properties")
        if build_main(["--model", str(make_tiny_model(root / "tiny")), "--name", "tiny", "--export-path",
                       str(root / "model_store"), "--config", str(config)]) != 0:
            raise SystemExit("building the tiny archive failed")
        server = TorchServe(config, root)
        server.start()
        try:
            server.wait_ready(timeout=600)
            url, headers = f"{server.url('inference')}/predictions/tiny", server.auth()
            warm_up(url, headers, texts, [1] * len(texts), seconds={CLIENTS: 20.0})
            for _ in range(repeats):
                for per in SHAPES:
                    for loop in loops:
                        for client in ("load.py", "aiohttp"):
                            key = f"{CLIENTS}x{per} {loop} {client}"
                            runs.setdefault(key, []).append(one_run(client, loop, url, headers, texts, per, seconds))
                            print(key, runs[key][-1], flush=True)
        finally:
            server.stop()
    medians = {key: {**sorted(rows, key=lambda r: r["client_cpu_us"])[len(rows) // 2],
                     "runs_client_cpu_us": [r["client_cpu_us"] for r in rows],
                     "runs_requests_per_s": [r["requests_per_s"] for r in rows]} for key, rows in runs.items()}
    ratios = {}
    for key, row in medians.items():
        if key.endswith(" load.py"):
            reference = medians[key.replace(" load.py", " aiohttp")]
            ratios[key.removesuffix(" load.py")] = {
                "client_cpu": round(row["client_cpu_us"] / reference["client_cpu_us"], 3),
                "requests_per_s": round(statistics.median(row["runs_requests_per_s"])
                                        / statistics.median(reference["runs_requests_per_s"]), 3)}
    return {"clients": CLIENTS, "seconds": seconds, "repeats": repeats, "runs": medians, "ratios": ratios,
            "cpu": describe_cpu()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.load_client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write load_client.json here")
    args = parser.parse_args(argv)
    result = measure(args.seconds, args.repeats)
    print(json.dumps(result["ratios"], indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load_client.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
