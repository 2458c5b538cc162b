"""The peer on the same machine: Infinity serving the same model folder, driven by the same load
client over the same shapes as bench/gpu_serve.py drives TorchServe (issue: a peer on the same GPU).

    python -m bench.peer_serve --model DIR --out OUT [--python PY] [--pythonpath DIR] [--device cuda]
                               [--dtype float16] [--shapes "1x1 64x1 256x1 64x32 256x32"] [--deadline EPOCH]

Infinity (`infinity_emb v2`, its torch engine) runs as its own process from the interpreter
`--python`, with `--pythonpath` before its own packages: Infinity 0.0.78 needs transformers 4.x
and sentence-transformers 3.x, where this project's environment (and the GPU machine's) has 5.x,
so scripts/gpu_peer.sh installs them into a folder of their own and puts it first. Its requests
are its OpenAI route's ({"model": ..., "input": texts}); each shape's row holds what
bench/gpu_serve.py's rows hold, with `server_cores` the CPU cores Infinity's process used (it
has no frontend and workers). OUT/peer.json is written after every phase, so a run cut short
keeps what it measured and names the phase it was in.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from bench.gpu_serve import (SHAPES, STOP_RESERVE_S, Gpu, OpenAIBody, Report, Sampler, _terminated, load_corpus,
                             load_plan, parse_shapes, run_shapes)

PEER = "infinity"
SERVED_NAME = "minilm"
PEER_PACKAGES = ("infinity_emb", "transformers", "sentence-transformers", "torch", "huggingface_hub", "tokenizers")
# Infinity reports its use to a telemetry service unless told not to; the machines have no network.
QUIET = {"INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
         "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def peer_environment(pythonpath: str | None) -> dict[str, str]:
    env = {**os.environ, **QUIET}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (pythonpath, os.environ.get("PYTHONPATH"))))
    return env


def peer_versions(python: str, env: dict[str, str]) -> dict:
    """The versions the peer's interpreter imports (its folder first), or why it could not say."""
    code = ("import importlib.metadata as m, json, sys\n"
            f"names = {list(PEER_PACKAGES)!r}\n"
            "found = {'python': sys.version.split()[0]}\n"
            "for n in names:\n"
            "    try: found[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: found[n] = None\n"
            "print(json.dumps(found))")
    try:
        done = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-1000:]}
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peer_command(python: str, model: Path, port: int, device: str, dtype: str, batch_size: int) -> list[str]:
    """Infinity's own CLI, as its README starts it: the torch engine, the model folder, on loopback."""
    return [python, "-m", "infinity_emb.cli", "v2", "--model-id", str(model), "--served-model-name", SERVED_NAME,
            "--engine", "torch", "--device", device, "--dtype", dtype, "--batch-size", str(batch_size),
            "--host", "127.0.0.1", "--port", str(port), "--url-prefix", ""]


def wait_ready(process: subprocess.Popen, url: str, until: float) -> float:
    """Seconds until Infinity's /health answers 200 (it does once the model is loaded and warmed)."""
    began = time.time()
    while time.time() < until:
        if process.poll() is not None:
            raise RuntimeError(f"{PEER} exited with status {process.returncode} before it was ready")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return time.time() - began
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{PEER} was not ready within {until - began:.0f} s")


def check_answer(url: str, text: str) -> dict:
    """One embedding from the peer: it answers on the route the load uses, with one vector."""
    answer = requests.post(f"{url}/embeddings", json=OpenAIBody(SERVED_NAME)([text]), timeout=60)
    answer.raise_for_status()
    vector = answer.json()["data"][0]["embedding"]
    return {"status": answer.status_code, "dimension": len(vector)}


def stop_peer(process: subprocess.Popen | None) -> float | None:
    """SIGTERM, then SIGKILL 15 s later: the seconds it took."""
    if process is None or process.poll() is not None:
        return None
    began = time.time()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)
    return round(time.time() - began, 1)


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    began = time.time()
    deadline = args.deadline or began + 600
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = parse_shapes(args.shapes, SHAPES)
    max_processes, load = load_plan(args)
    env = peer_environment(args.pythonpath)
    report = Report(out / "peer.json", peer=PEER, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                    budget_deadline=round(deadline, 1))
    gpu = Gpu()
    report.data.update(versions=peer_versions(args.python, env),
                       gpu=gpu.describe() or {"available": False, "why": gpu.why},
                       load={**load, "route": "OpenAI /embeddings"})
    report.write()
    process = None
    pool_box: list = []
    code = 1
    log = open(out / "peer_server.log", "w")
    try:
        report.phase("corpus")
        model = Path(args.model)
        texts, tokens = load_corpus(model)
        pool_box.append(multiprocessing.get_context("spawn").Pool(max_processes))
        report.phase("start")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = peer_command(args.python, model, port, args.device, args.dtype, args.batch_size)
        report.data["command"] = command[1:]
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        ready_s = wait_ready(process, url, min(deadline - STOP_RESERVE_S, time.time() + args.start_timeout))
        report.data["startup"] = {"ready_s": round(ready_s, 2), "pid": process.pid, **check_answer(url, texts[0])}
        report.write()
        print(f"{PEER} ready in {ready_s:.1f} s", file=sys.stderr, flush=True)

        sampler = Sampler(gpu, process.pid)
        sampler.start()
        report.data["shapes"] = []
        try:
            run_shapes(report, shapes, len(shapes), 0, deadline, args, pool_box, f"{url}/embeddings", {}, texts,
                       tokens, max_processes, sampler, OpenAIBody(SERVED_NAME))
        finally:
            sampler.done.set()
        for row in report.data["shapes"]:  # one process: the sampler's "frontend" is the server itself
            if "frontend_cores" in row:
                row["server_cores"] = row.pop("frontend_cores")
            row.pop("workers_cores", None)
            row.pop("workers", None)
        code = 0 if not report.data["errors"] and all(
            "texts_per_s" in r and not r["errors"] for r in report.data["shapes"]) else 1
    except Exception as err:  # the peer did not start, a time limit, anything: recorded, then it stops
        report.fail(report.data["phase"], f"{type(err).__name__}: {err}")
    finally:
        for pool in pool_box:
            pool.terminate()
        report.phase("stop")
        try:
            report.data["stop_s"] = stop_peer(process)
        except Exception as err:
            report.fail("stop", f"{type(err).__name__}: {err}")
            code = 1
        log.close()
        tail = (out / "peer_server.log").read_text(errors="replace").splitlines()[-40:]
        report.data.update(phase="done", complete=code == 0, duration_s=round(time.time() - began, 1),
                           server_log_tail=tail if code else tail[-5:])
        report.write()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.peer_serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model folder (its tokenizer makes the corpus)")
    parser.add_argument("--out", required=True, help="where peer.json goes")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs Infinity")
    parser.add_argument("--pythonpath", default=None, help="a folder put before that interpreter's packages")
    parser.add_argument("--device", default="cuda", help="Infinity's --device: cuda or cpu")
    parser.add_argument("--dtype", default="float16", help="Infinity's --dtype: float16, float32, bfloat16 or auto")
    parser.add_argument("--batch-size", type=int, default=32, help="Infinity's --batch-size (its default 32)")
    parser.add_argument("--deadline", type=float, default=0.0, help="epoch seconds by which the run has stopped")
    parser.add_argument("--shapes", default="", help='default "1x1 64x1 256x1 64x32 256x32" (clients x texts per request)')
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per shape, at most")
    parser.add_argument("--warmup", type=float, default=4.0, help="uncounted seconds of each shape first")
    parser.add_argument("--processes", type=int, default=0, help="load processes at most (0: half the CPUs)")
    parser.add_argument("--start-timeout", type=float, default=240.0, help="seconds until Infinity must be ready")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
