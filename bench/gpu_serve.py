"""End to end through TorchServe, for scripts/gpu_serve.sh: start a server on a built archive,
run closed-loop load shapes against it while sampling the GPU and the CPUs, and stop it.

    python -m bench.gpu_serve run --config C --workdir W --model DIR --out OUT [--deadline EPOCH] ...
    python -m bench.gpu_serve stop --config C --workdir W     # stop it, whatever state it is in

`run` writes OUT/serving.json after every phase (versions, start, each shape, stop), so a run cut
short leaves what it measured and names the phase it was in. With `--workers "4 8"` it then scales
the model to each count (TorchServe's management API, synchronous) and runs the sweep shapes
again: each row says its worker count, `workers` the counts with their idle GPU memory, and
`sizing` the GPU memory a worker holds idle and at load (fitted over the counts) and how many
workers keep the GPU within MEMORY_SHARE of its memory (the sizing rule's figures; a GPU only). The load of a shape is split over
several processes (bench/load.py's run_load in each, started together): one Python process does
not generate the target rate of one-text requests on its own.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import requests

from bench.load import run_load

SHAPES = ((1, 1), (64, 1), (256, 1), (64, 32), (256, 32))  # (clients, texts per request)
# The shapes run again at each worker count of a sweep (--workers): the two the targets name.
SWEEP_SHAPES = ((256, 1), (64, 32))
# The sizing rule: the GPU holds 75-85% of its memory with every worker loaded at its largest batch.
MEMORY_SHARE = 0.80
TARGET = {"texts_per_s": 10_000, "clients": 256}
CLIENTS_PER_PROCESS = 32
SAMPLE_S = 0.25
SHAPE_OVERHEAD_S = 3.0  # starting the processes, the last requests, the summary
STOP_RESERVE_S = 25.0  # what `run` keeps of its deadline for stopping the server
BATCH_RESERVE_S = 20.0  # what the shapes leave of the deadline for `embedserve batch` after them
PACKAGES = ("torch", "transformers", "sentence-transformers", "tokenizers", "safetensors", "numpy", "orjson",
            "uvloop", "nvidia-ml-py", "psutil", "torchserve", "torch-model-archiver")


class Report:
    def __init__(self, path: Path, **fields) -> None:
        self.path = path
        self.data: dict = {"complete": False, "phase": "versions", "failed_step": None, "errors": {}, **fields}
        self.write()

    def write(self) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=2))
        partial.replace(self.path)

    def phase(self, name: str) -> None:
        self.data["phase"] = name
        self.write()
        print(f"-- {name}", file=sys.stderr, flush=True)

    def fail(self, step: str, error: str) -> None:
        self.data["errors"][step] = error[-3000:]
        self.data["failed_step"] = self.data["failed_step"] or step
        self.write()
        print(f"FAILED {step}: {error[-1500:]}", file=sys.stderr, flush=True)


# --- versions -------------------------------------------------------------------------------------

def offered_tensorrt() -> dict:
    """What the machine offers a TensorRT engine (bench/gpu/tensorrt.py), or why that is unknown."""
    try:
        from bench.gpu.tensorrt import tensorrt_offer

        return tensorrt_offer()
    except Exception as err:  # onnxruntime missing or broken: recorded, the run goes on
        return {"error": f"{type(err).__name__}: {err}"}


def versions() -> dict:
    found: dict = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    java = Path(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else shutil.which("java")
    try:
        done = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30)
        found["java"] = done.stderr.strip().splitlines()[0] if done.stderr.strip() else f"exit {done.returncode}"
        found["java_path"] = str(java)
    except (OSError, subprocess.SubprocessError, TypeError) as err:
        found["java"] = f"not runnable: {err}"
    return found


class Gpu:
    """NVML when it answers (device 0: the one TorchServe's only worker gets), else none."""

    def __init__(self) -> None:
        self.handle = None
        self.why = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as err:  # no driver, no GPU, no pynvml: the CPU mode
            self.why = f"{type(err).__name__}: {err}"

    def describe(self) -> dict | None:
        if self.handle is None:
            return None
        nvml = self.nvml
        name = nvml.nvmlDeviceGetName(self.handle)
        driver = nvml.nvmlSystemGetDriverVersion()
        return {"name": name.decode() if isinstance(name, bytes) else name,
                "driver": driver.decode() if isinstance(driver, bytes) else driver,
                "memory_total_mib": round(nvml.nvmlDeviceGetMemoryInfo(self.handle).total / 2**20)}

    def sample(self) -> tuple[float, float] | None:
        if self.handle is None:
            return None
        try:
            util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
            memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20
            return float(util), float(memory)
        except Exception:
            return None


class Sampler(threading.Thread):
    """Every SAMPLE_S: the GPU's utilisation and memory, and the CPU seconds so far of the frontend
    (the JVM), of its workers (its child processes) and of the whole machine."""

    def __init__(self, gpu: Gpu, jvm_pid: int | None) -> None:
        super().__init__(daemon=True)
        self.gpu, self.jvm_pid = gpu, jvm_pid
        self.samples: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        jvm = None
        try:
            jvm = psutil.Process(self.jvm_pid) if self.jvm_pid else None
        except psutil.Error:
            pass
        while not self.done.is_set():
            row: dict = {"t": time.time()}
            reading = self.gpu.sample()
            if reading:
                row["gpu_util"], row["gpu_mem_mib"] = reading
            times = psutil.cpu_times()
            row["host_busy_s"] = sum(times) - times.idle - getattr(times, "iowait", 0.0)
            if jvm is not None:
                try:
                    cpu = jvm.cpu_times()
                    row["frontend_s"] = cpu.user + cpu.system
                    workers = 0.0
                    for child in jvm.children(recursive=True):
                        try:
                            c = child.cpu_times()
                            workers += c.user + c.system
                        except psutil.Error:
                            pass
                    row["workers_s"] = workers
                except psutil.Error:
                    pass
            self.samples.append(row)
            self.done.wait(SAMPLE_S)

    def window(self, start: float, end: float) -> dict:
        rows = [r for r in self.samples if start <= r["t"] <= end]
        out: dict = {"samples": len(rows)}
        util = [r["gpu_util"] for r in rows if "gpu_util" in r]
        if util:
            out["gpu_util_mean"] = round(float(np.mean(util)), 1)
            out["gpu_util_max"] = round(float(np.max(util)), 1)
            out["gpu_mem_used_mib_max"] = round(max(r["gpu_mem_mib"] for r in rows if "gpu_mem_mib" in r))
        if len(rows) >= 2:
            first, last = rows[0], rows[-1]
            span = last["t"] - first["t"]
            for key in ("host_busy_s", "frontend_s", "workers_s"):
                if key in first and key in last and span > 0:
                    # CPU seconds per second: 1.0 is one core kept busy.
                    out[f"{key[:-2]}_cores"] = round((last[key] - first[key]) / span, 2)
        return out


# --- the load ------------------------------------------------------------------------------------

class OpenAIBody:
    """A request's body on an OpenAI-style route: {"model": name, "input": texts}. A class, not a
    lambda: the load processes receive it pickled."""

    def __init__(self, model: str) -> None:
        self.model = model

    def __call__(self, texts: list[str]) -> dict:
        return {"model": self.model, "input": texts}


def _load_part(url: str, headers: dict, texts: list[str], tokens: list[int], clients: int, per_request: int,
               warmup: float, seconds: float, start_at: float, body: OpenAIBody | None = None) -> dict:
    """One load process's share of a shape (run in a process of its own); `body`: the request's
    body from its texts (default: the native route's {"input": texts})."""
    uvloop = False
    try:
        import asyncio
        import uvloop as _uvloop

        asyncio.set_event_loop_policy(_uvloop.EventLoopPolicy())
        uvloop = True
    except Exception:  # uvloop is optional: asyncio's own loop then
        pass
    time.sleep(max(0.0, start_at - time.time()))
    cpu = time.process_time()
    result = run_load(url, headers, texts, tokens, concurrency=clients, texts_per_request=per_request,
                      seconds=seconds, warmup_seconds=warmup, body=body)
    end = time.time()
    return {"clients": clients, "end": end, "start": end - result.seconds, "requests": result.requests,
            "texts": result.texts, "tokens": result.tokens, "errors": result.errors,
            "latencies_ms": result.latencies_ms, "cpu_s": time.process_time() - cpu, "uvloop": uvloop}


def split(clients: int, processes: int) -> list[int]:
    share, extra = divmod(clients, processes)
    return [share + (i < extra) for i in range(processes)]


def run_shape(pool, url: str, headers: dict, texts: list[str], tokens: list[int], clients: int, per_request: int,
              warmup: float, seconds: float, max_processes: int, sampler: Sampler, wait_s: float,
              body: OpenAIBody | None = None) -> dict:
    """One shape's figures; TimeoutError when its processes have not all answered within `wait_s`."""
    processes = max(1, min(max_processes, clients, math.ceil(clients / CLIENTS_PER_PROCESS)))
    start_at = time.time() + 0.5  # every process starts its clients at once
    pending = pool.starmap_async(_load_part, [(url, headers, texts, tokens, n, per_request, warmup, seconds,
                                               start_at, body) for n in split(clients, processes)])
    try:
        parts = pending.get(timeout=wait_s)
    except multiprocessing.TimeoutError:
        raise TimeoutError(f"the load processes did not finish within {wait_s:.0f} s (the budget's limit, or "
                           "60 s past the shape's time): requests too slow to answer") from None
    start, end = min(p["start"] for p in parts), max(p["end"] for p in parts)
    elapsed = end - start
    latencies = np.concatenate([np.asarray(p["latencies_ms"], dtype=float) for p in parts]) if any(
        p["latencies_ms"] for p in parts) else np.array([np.nan])
    errors: dict[str, int] = {}
    for part in parts:
        for status, count in part["errors"].items():
            errors[str(status)] = errors.get(str(status), 0) + count
    texts_done = sum(p["texts"] for p in parts)
    row = {
        "clients": clients, "texts_per_request": per_request, "load_processes": processes,
        "uvloop": all(p["uvloop"] for p in parts), "warmup_s": warmup, "seconds": round(elapsed, 2),
        "requests": sum(p["requests"] for p in parts), "texts": texts_done, "errors": errors,
        "texts_per_s": round(texts_done / elapsed, 1),
        "requests_per_s": round(sum(p["requests"] for p in parts) / elapsed, 1),
        "tokens_per_s": round(sum(p["tokens"] for p in parts) / elapsed, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)), 2),
        "p95_ms": round(float(np.percentile(latencies, 95)), 2),
        "p99_ms": round(float(np.percentile(latencies, 99)), 2),
        "load_cores": round(sum(p["cpu_s"] for p in parts) / (end - start_at), 2),
    }
    row.update(sampler.window(start, end))
    return row


def plan_seconds(left: float, shapes: int, warmup: float, seconds: float) -> float:
    """The measured seconds per shape that fit `left` (at least 2; fewer shapes run otherwise)."""
    fit = left / shapes - warmup - SHAPE_OVERHEAD_S
    return max(2.0, min(seconds, fit))


# --- run and stop -----------------------------------------------------------------------------------

def run_shapes(report: Report, shapes: list[tuple[int, int]], planned: int, workers: int, deadline: float,
               args: argparse.Namespace, pool_box: list, url: str, headers: dict, texts: list[str],
               tokens: list[int], max_processes: int, sampler: Sampler, body: OpenAIBody | None = None) -> int:
    """Each shape at the server's `workers`, its row in the report (or why it has none), within the
    deadline shared by the `planned` shapes left. How many were planned here."""
    for index, (clients, per_request) in enumerate(shapes):
        name = f"{clients}x{per_request}" + (f" at {workers} workers" if workers else "")
        left = deadline - time.time() - STOP_RESERVE_S
        seconds = plan_seconds(left, max(1, planned - index), args.warmup, args.seconds)
        if left < args.warmup + seconds + SHAPE_OVERHEAD_S:
            report.fail(f"shape {name}", f"skipped: {left:.0f} s left of the budget")
            report.data["shapes"].append({"clients": clients, "texts_per_request": per_request, "workers": workers,
                                          "skipped": "out of budget"})
            continue
        report.phase(f"shape {name}")
        try:
            wait_s = min(args.warmup + seconds + 60, deadline - time.time() - STOP_RESERVE_S)
            row = {"workers": workers, **run_shape(pool_box[-1], url, headers, texts, tokens, clients, per_request,
                                                   args.warmup, seconds, max_processes, sampler, wait_s, body)}
        except Exception as err:  # a load process died or timed out: the next shape still runs
            pool_box[-1].terminate()
            pool_box.append(multiprocessing.get_context("spawn").Pool(max_processes))
            report.data["shapes"].append({"clients": clients, "texts_per_request": per_request, "workers": workers,
                                          "error": f"{type(err).__name__}: {err}"})
            report.fail(f"shape {name}", f"{type(err).__name__}: {err}")
            continue
        report.data["shapes"].append(row)
        report.write()
        if row["errors"]:
            report.fail(f"shape {name}", f"requests answered with errors (HTTP status: count): {row['errors']}")
        gpu_note = f", GPU {row['gpu_util_mean']}% mean {row['gpu_util_max']}% max" if "gpu_util_mean" in row else ""
        print(f"{name}: {row['texts_per_s']} texts/s, p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, "
              f"errors {row['errors'] or 0}, {row['load_processes']} load processes{gpu_note}",
              file=sys.stderr, flush=True)
    return len(shapes)


def run_batch(server, args: argparse.Namespace, texts: list[str], sampler: Sampler, deadline: float) -> dict:
    """`embedserve batch` as a user runs it against the server: a JSONL table of `--batch-texts`
    texts (the corpus over and over), its concurrency sized from the server's workers and batch
    size (the management API), results in input order. Its texts/s, and the cores and GPU over
    its run."""
    work = Path(args.workdir) / "batch"
    work.mkdir(exist_ok=True)
    table, results = work / "texts.jsonl", work / "vectors.jsonl"
    results.unlink(missing_ok=True)
    with table.open("w") as out:
        for i in range(args.batch_texts):
            out.write(json.dumps({"id": i, "text": texts[i % len(texts)]}) + "\n")
    command = [sys.executable, "-m", "embedserve.batch", str(table), str(results), "--model", args.name,
               "--url", server.client_url("inference"), "--management-url", server.client_url("management"),
               "--progress", "none"]
    if (Path(args.workdir) / "key_file.json").is_file():
        command += ["--key-file", str(Path(args.workdir) / "key_file.json")]
    limit = deadline - time.time() - STOP_RESERVE_S
    began = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(1.0, limit))
    except subprocess.TimeoutExpired:
        return {"texts": args.batch_texts, "error": f"not done within the {limit:.0f} s left of the budget"}
    end = time.time()
    answered = 0
    if results.is_file():  # 100,000 vectors: counted as it streams, not read whole
        with results.open("rb") as lines:
            answered = sum(1 for _ in lines)
    row = {"texts": args.batch_texts, "answered": answered, "exit": done.returncode,
           "seconds": round(end - began, 2), "texts_per_s": round(answered / (end - began), 1),
           "log_tail": (done.stdout + done.stderr).strip().splitlines()[-5:], **sampler.window(began, end)}
    if done.returncode != 0 or answered != args.batch_texts:
        row["error"] = f"exit {done.returncode}, {answered} of {args.batch_texts} answered"
    print(f"embedserve batch of {args.batch_texts}: {row['texts_per_s']} texts/s in {row['seconds']} s, "
          f"exit {done.returncode}", file=sys.stderr, flush=True)
    return row


def ready_workers(management: tuple[str, dict]) -> tuple[int, int]:
    """(the model's workers that are up, the workers it was registered with): TorchServe's management API."""
    url, headers = management
    answer = requests.get(url, headers=headers, timeout=30)
    answer.raise_for_status()
    described = answer.json()
    ready = sum(worker.get("status") == "READY" for version in described for worker in version["workers"])
    return ready, described[0].get("minWorkers", 1)


SETTLED_MIB = 64  # two readings a second apart within this: the GPU's memory has settled


def worker_point(management: tuple[str, dict], gpu: Gpu, settle_s: float = 20.0) -> dict:
    """The model's running workers and the GPU memory in use, idle, once it has settled: TorchServe
    answers a synchronous scale-down before the stopped workers' processes have exited (on the H200
    the memory read at once after 8 -> 2 was still the 8 workers')."""
    reading, until = gpu.sample(), time.time() + settle_s
    while reading and time.time() < until:
        time.sleep(1.0)
        later = gpu.sample()
        if later is None or abs(later[1] - reading[1]) < SETTLED_MIB:
            break
        reading = later
    return {"workers": ready_workers(management)[0], "gpu_mem_idle_mib": round(reading[1]) if reading else None}


def wait_all_workers(management: tuple[str, dict], until: float) -> int:
    """Wait until every worker the model was registered with is up: TorchServe is ready with its
    first, and a shape measured while the others load (each capturing its CUDA graphs) would
    count fewer. How many are up when it returns (by `until` at the latest)."""
    while True:
        ready, registered = ready_workers(management)
        if ready >= registered or time.time() >= until:
            return ready
        time.sleep(0.5)


def scale_workers(management: tuple[str, dict], count: int, within_s: float) -> float:
    """Scale the model to `count` workers and wait until they are up (TorchServe's synchronous
    scaling, which answers when they are): the seconds it took."""
    if within_s < 10:
        raise TimeoutError(f"{within_s:.0f} s left of the budget: too little to start workers")
    url, headers = management
    began = time.time()
    answer = requests.put(f"{url}?min_worker={count}&max_worker={count}&synchronous=true", headers=headers,
                          timeout=within_s)
    if answer.status_code >= 300:
        raise RuntimeError(f"scaling to {count} workers: HTTP {answer.status_code} {answer.text[:300]}")
    return round(time.time() - began, 1)


def sizing(points: list[dict], shapes: list[dict], gpu: dict | None) -> dict:
    """The sizing rule's figures from a sweep: GPU memory a worker holds, idle (its CUDA context,
    weights and graph pools) and at load (the largest batch's activations), fitted over the worker
    counts measured, and how many workers keep the GPU within MEMORY_SHARE of its memory."""
    if gpu is None:
        return {"why": "no GPU: memory per worker is measured on one"}
    idle = sorted((p["workers"], p["gpu_mem_idle_mib"]) for p in points if p.get("gpu_mem_idle_mib") is not None)
    peak: dict[int, float] = {}
    for row in shapes:
        if "gpu_mem_used_mib_max" in row:
            peak[row["workers"]] = max(peak.get(row["workers"], 0.0), row["gpu_mem_used_mib_max"])
    if len({count for count, _ in idle}) < 2 or len(peak) < 2:
        return {"why": "fewer than two worker counts measured", "idle_mib": dict(idle), "peak_mib": peak}
    per_worker_idle, base_idle = np.polyfit(*zip(*idle), 1)
    per_worker_peak, base_peak = np.polyfit(list(peak), list(peak.values()), 1)
    total = gpu["memory_total_mib"]
    fit = int((MEMORY_SHARE * total - base_peak) // per_worker_peak) if per_worker_peak > 0 else None
    return {"memory_total_mib": total, "per_worker_idle_mib": round(float(per_worker_idle)),
            "per_worker_at_load_mib": round(float(per_worker_peak)), "base_mib": round(float(base_peak)),
            "workers_within_share": fit, "share": MEMORY_SHARE, "idle_mib": dict(idle), "peak_mib": peak}


def parse_shapes(text: str, default: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """"64x1 64x32" as [(64, 1), (64, 32)] (clients x texts per request); `default` when empty."""
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split()] if text else list(default)


def load_plan(args: argparse.Namespace) -> tuple[int, dict]:
    """The load processes at most (`--processes`, else half the CPUs), and the load's settings as the report records them."""
    processes = args.processes or max(1, (os.cpu_count() or 2) // 2)
    return processes, {"max_processes": processes, "clients_per_process": CLIENTS_PER_PROCESS, "warmup_s": args.warmup,
                       "seconds_asked": args.seconds, "cpu_count": os.cpu_count(),
                       "corpus": "mixed (4-256 tokens, median 36), 2048 texts"}


def load_corpus(model: Path) -> tuple[list[str], list[int]]:
    """The mixed corpus (4-256 tokens, median 36) by the model's tokenizer, and each text's tokens."""
    from embedserve.archive.corpus import load_tokenizer, mixed_corpus

    tokenizer = load_tokenizer(model / "tokenizer.json")
    texts = mixed_corpus(model / "tokenizer.json", 2048)
    return texts, [len(tokenizer.encode(t).ids) for t in texts]


def run(args: argparse.Namespace) -> int:
    from embedserve.scripts.serverctl import TorchServe

    signal.signal(signal.SIGTERM, _terminated)  # a time limit: record it, then stop the server (finally)
    began = time.time()
    deadline = args.deadline or began + 600
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = parse_shapes(args.shapes, SHAPES)
    max_processes, load = load_plan(args)
    report = Report(out / "serving.json", device=args.device, budget_deadline=round(deadline, 1),
                    target={**TARGET, "shape": "256 clients, any texts per request", "met": None})
    gpu = Gpu()
    report.data.update(versions=versions(), gpu=gpu.describe() or {"available": False, "why": gpu.why}, load=load,
                       tensorrt=offered_tensorrt())
    report.write()

    server = TorchServe(Path(args.config), Path(args.workdir))
    pool_box: list = []  # the load processes' pool, replaced where a shape's processes die
    code = 1
    try:
        # The corpus and the load processes first: neither then takes from the server's time.
        report.phase("corpus")
        texts, tokens = load_corpus(Path(args.model))
        pool_box.append(multiprocessing.get_context("spawn").Pool(max_processes))
        report.phase("start")
        started = time.time()
        server.start()
        jvm_pid = None
        for _ in range(20):  # the launcher writes the pid file a moment after it returns
            jvm_pid = server.pid()
            if jvm_pid:
                break
            time.sleep(0.1)
        (Path(args.workdir) / "jvm.pid").write_text(str(jvm_pid or ""))
        frontend_s = None
        while time.time() < min(deadline, started + args.start_timeout):
            try:  # any HTTP answer: the frontend is up (with token authorization, /ping answers 400)
                requests.get(f"{server.client_url('inference')}/ping", timeout=2)
                frontend_s = time.time() - started
                break
            except requests.RequestException:
                pass
            if server.pid() is None:
                break
            time.sleep(0.2)
        server.wait_ready(timeout=max(5.0, min(args.start_timeout, deadline - time.time() - STOP_RESERVE_S)))
        report.data["startup"] = {"frontend_up_s": round(frontend_s, 2) if frontend_s else None,
                                  "ready_s": round(time.time() - started, 2), "jvm_pid": jvm_pid}
        report.write()
        print(f"TorchServe ready in {time.time() - started:.1f} s (the frontend answered "
              f"after {frontend_s or float('nan'):.1f} s)", file=sys.stderr, flush=True)

        url = f"{server.client_url('inference')}/predictions/{args.name}"
        headers = server.auth_if_on()

        sampler = Sampler(gpu, jvm_pid)
        sampler.start()
        report.data["shapes"] = []
        management = (f"{server.client_url('management')}/models/{args.name}", server.auth_if_on("management"))
        wait_all_workers(management, min(deadline - STOP_RESERVE_S - 30, started + args.start_timeout))
        report.data["startup"]["all_workers_s"] = round(time.time() - started, 2)
        report.write()
        sweep = [int(n) for n in args.workers.split()]
        sweep_shapes = parse_shapes(args.sweep_shapes, SWEEP_SHAPES)
        planned = len(shapes) + len(sweep) * len(sweep_shapes)
        try:
            built = worker_point(management, gpu)
            report.data["workers"] = [built]
            # The shapes leave the batch its time (100,000 texts at the H200's 7,212 texts/s: 14 s).
            ran = run_shapes(report, shapes, planned, built["workers"],
                             deadline - (BATCH_RESERVE_S if args.batch_texts else 0), args, pool_box, url, headers,
                             texts, tokens, max_processes, sampler)
            if args.batch_texts:
                report.phase(f"batch of {args.batch_texts}")
                report.data["batch"] = run_batch(server, args, texts, sampler, deadline)
                report.write()
                if "error" in report.data["batch"]:
                    report.fail(f"batch of {args.batch_texts}", report.data["batch"]["error"])
            last_up_s = 0.0  # the last scale-up's seconds: what the next one needs at least
            for count in sweep:
                report.phase(f"workers {count}")
                left = deadline - time.time() - STOP_RESERVE_S
                up = count > report.data["workers"][-1]["workers"]
                if up and left < last_up_s:
                    # A scale-up cut by the budget leaves TorchServe mid-start, and its stop fails.
                    report.fail(f"workers {count}", f"skipped: {left:.0f} s left of the budget, "
                                                    f"the last scale-up took {last_up_s:.0f} s")
                    break
                try:
                    scaled = scale_workers(management, count, left)
                    if up:
                        last_up_s = scaled
                    point = {**worker_point(management, gpu), "scale_s": scaled}
                except Exception as err:  # a scale that fails or runs out of time: the figures so far stand
                    report.fail(f"workers {count}", f"{type(err).__name__}: {err}")
                    break
                report.data["workers"].append(point)
                report.write()
                ran += run_shapes(report, sweep_shapes, planned - ran, count, deadline, args, pool_box, url, headers,
                                  texts, tokens, max_processes, sampler)
        finally:
            sampler.done.set()
        report.data["sizing"] = sizing(report.data["workers"], report.data["shapes"], gpu.describe())
        at_target = [r for r in report.data["shapes"] if r.get("clients") == TARGET["clients"] and "texts_per_s" in r]
        if at_target:
            best = max(at_target, key=lambda r: r["texts_per_s"])
            report.data["target"].update(best_texts_per_s=best["texts_per_s"],
                                         best_shape=f"{best['clients']}x{best['texts_per_request']} at "
                                                    f"{best['workers']} workers",
                                         met=best["texts_per_s"] >= TARGET["texts_per_s"])
        code = 0 if not report.data["errors"] and all(
            "texts_per_s" in r and not r["errors"] for r in report.data["shapes"]) else 1
    except Exception as err:  # ServerError, a time limit's SIGTERM, anything: recorded, then the server stops
        report.fail(report.data["phase"], f"{type(err).__name__}: {err}")
    finally:
        for pool in pool_box:
            pool.terminate()
        report.phase("stop")
        stop_began = time.time()
        try:
            server.stop(timeout=15, drain_s=3)
            report.data["stop_s"] = round(time.time() - stop_began, 1)
        except Exception as err:
            report.fail("stop", f"{type(err).__name__}: {err}")
            kill_leftovers(Path(args.workdir))
            code = 1
        report.data.update(phase="done", complete=code == 0, duration_s=round(time.time() - began, 1))
        report.write()
    return code


def _terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the stop that follows must not be cut
    raise TimeoutError("terminated (the step's time limit)")


def kill_leftovers(workdir: Path) -> list[int]:
    """SIGKILL the frontend this run started (its pid, from workdir/jvm.pid) and its workers."""
    import psutil

    try:
        pid = int((workdir / "jvm.pid").read_text().strip())
        jvm = psutil.Process(pid)
        family = [*jvm.children(recursive=True), jvm]
    except (OSError, ValueError, psutil.Error):
        return []
    killed = []
    for process in family:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped: nothing to stop
                continue
            process.send_signal(signal.SIGKILL)
            killed.append(process.pid)
        except psutil.Error:
            pass
    return killed


def stop(args: argparse.Namespace) -> int:
    """Stop the run's server, drained briefly; kill what is left of it if that fails."""
    from embedserve.scripts.serverctl import TorchServe

    workdir = Path(args.workdir)
    try:
        server = TorchServe(Path(args.config), workdir)
        if server.pid() is not None:
            server.stop(timeout=20, drain_s=2)
            print("TorchServe stopped", file=sys.stderr)
    except Exception as err:
        print(f"stop: {type(err).__name__}: {err}", file=sys.stderr)
    killed = kill_leftovers(workdir)
    if killed:
        print(f"killed what was left of the server: pids {killed}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("run", "stop"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--model", help="the model folder (its tokenizer makes the corpus)")
    parser.add_argument("--out", help="where serving.json goes")
    parser.add_argument("--name", default="minilm", help="the model's name in URLs")
    parser.add_argument("--device", default="cuda", help="recorded in the report")
    parser.add_argument("--deadline", type=float, default=0.0, help="epoch seconds by which `run` has stopped")
    parser.add_argument("--shapes", default="", help='default "1x1 64x1 256x1 64x32 256x32" (clients x texts per request)')
    parser.add_argument("--workers", default="", help='worker counts to scale to after the shapes, each running '
                        'the sweep shapes (e.g. "4 8 12"); default none')
    parser.add_argument("--sweep-shapes", default="", help='the shapes at each swept worker count; default "256x1 64x32"')
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per shape, at most")
    parser.add_argument("--warmup", type=float, default=4.0, help="uncounted seconds of each shape first")
    parser.add_argument("--processes", type=int, default=0, help="load processes at most (0: half the CPUs)")
    parser.add_argument("--start-timeout", type=float, default=240.0, help="seconds until the model must embed")
    parser.add_argument("--batch-texts", type=int, default=0,
                        help="after the shapes, `embedserve batch` of this many texts (0: none)")
    args = parser.parse_args(argv)
    if args.action == "stop":
        return stop(args)
    if not (args.model and args.out):
        parser.error("run needs --model and --out")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
