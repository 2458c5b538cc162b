"""Where GPU workers' host time goes on multi-text batches, without TorchServe: N engines in N
processes (as N workers of one GPU), each started as a worker starts it, run the same TorchServe
batch (8 requests of 32 mixed texts) back to back, in phases: the first alone, then all of them
together, in each variant of VARIANTS (torch's CPU threads; how the batch's read-back waits).
Per phase: texts/s of all processes, CPU time per text (every thread of each process, spinning ones
too), the first's stage times per text and the GPU's busy % (NVML); then the first one's cProfile of
three batches as served. Writes host_probe.json into --out.

    python -m bench.gpu_host_probe MODEL_DIR --device cuda --procs 8 --out DIR

It found that a GPU worker left torch at its default of every core (placement's GPU_TORCH_THREADS).
In CPU mode (--device cpu) it runs as a check of itself: the figures then are a CPU's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import queue
import sys
import threading
import time
from pathlib import Path

# name: (read-back, torch's CPU threads). The threads: "default" is torch's own, every core (what
# a GPU worker ran before placement's GPU_TORCH_THREADS; run 5's "served"), "served" what the
# engine's placement set, "share" the cores over the processes. The read-back: "spin" is .cpu() as
# served; "blocking" waits on a blocking CUDA event first (the CPU sleeps).
VARIANTS = {"torch-default": ("spin", "default"), "served": ("spin", "served"), "threads-share": ("spin", "share"),
            "share-blocking": ("blocking", "share")}
SOLO = ("torch-default", "served")


def _requests(texts, per: int, count: int):
    from embedserve.handler.api.exchange import RawRequest
    out = []
    for i in range(count):
        chunk = [texts[(i * per + j) % len(texts)] for j in range(per)]
        body = {"input": chunk[0] if per == 1 else chunk}
        out.append(RawRequest(bytearray(json.dumps(body).encode()), "application/json", ""))
    return out


def _blocking_to_host(vectors):
    import torch

    if vectors.device.type == "cpu":
        return vectors
    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()
    return vectors.cpu()


def _use(name: str, threads: dict[str, int], served_to_host) -> None:
    import torch
    from embedserve.handler.execution.encoder import Encoder

    read_back, count = VARIANTS[name]
    torch.set_num_threads(threads[count])
    Encoder.to_host = staticmethod(_blocking_to_host if read_back == "blocking" else served_to_host)


def child(rank, args, barrier, results):
    import torch
    from embedserve.archive.corpus import mixed_corpus
    from embedserve.handler.assembly import assemble
    from embedserve.handler.execution.encoder import Encoder
    from embedserve.handler.settings import Settings

    served_to_host = Encoder.to_host
    default_threads = torch.get_num_threads()  # before the placement sets the engine's
    model = Path(args.model)
    texts = mixed_corpus(model / "tokenizer.json", 2048)
    started = time.perf_counter()
    engine = assemble(model, Settings.from_mapping({"device": args.device}), model_name="m",
                      cuda_available=torch.cuda.is_available(), warm=True)
    batch = _requests(texts, args.per, args.requests)
    engine.handle_with_report(batch)
    mine = {"rank": rank, "startup_s": round(time.perf_counter() - started, 1), "phases": {}}
    phases = [("solo-" + v, v) for v in SOLO] + [("all-" + v, v) for v in VARIANTS]
    threads = {"default": default_threads, "served": torch.get_num_threads(),
               "share": max(1, os.cpu_count() // args.procs)}
    for name, variant in phases:
        barrier.wait()
        if name.startswith("solo") and rank:
            continue
        _use(variant, threads, served_to_host)
        stages, done, cpu0, t0, epoch = {}, 0, time.process_time(), time.perf_counter(), time.time()
        while time.perf_counter() - t0 < args.seconds:
            _, report = engine.handle_with_report(batch)
            done += 1
            for key, value in vars(report).items():
                if key.endswith("_ms") and isinstance(value, (int, float)):
                    stages[key] = stages.get(key, 0.0) + value
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        n = done * args.per * args.requests
        mine["phases"][name] = {"texts": n, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "epoch": (epoch, epoch + wall),
                                "stage_us_per_text": {k[:-3]: round(v * 1e3 / n, 1) for k, v in stages.items()}}
    barrier.wait()
    if rank == 0:
        _use("served", threads, served_to_host)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3):
            engine.handle_with_report(batch)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        mine["profile"] = text.getvalue()[:6000]
        mine["threads"] = {**threads, "RAYON_NUM_THREADS": os.environ.get("RAYON_NUM_THREADS")}
    results.put(mine)


def gpu_sampler(stop, samples):
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:
        return
    while not stop.is_set():
        samples.append((time.time(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--per", type=int, default=32, help="texts a request")
    parser.add_argument("--requests", type=int, default=8, help="requests a batch")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    # A served GPU worker's tokenizer pool: the cores over the workers (Placement.tokenizer_threads).
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, os.cpu_count() // args.procs)))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.procs), ctx.Queue()
    procs = [ctx.Process(target=child, args=(r, args, barrier, results)) for r in range(args.procs)]
    for p in procs:
        p.start()
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=gpu_sampler, args=(stop, samples), daemon=True)
    sampler.start()
    rows = []
    try:
        while len(rows) < len(procs):
            try:
                rows.append(results.get(timeout=1.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:  # a child that failed would leave the others waiting at the barrier
                    raise SystemExit(f"gpu_host_probe: an engine's process failed (exit {dead[0]}); its traceback is above")
    finally:
        stop.set()
        for p in procs:
            p.join(30 if len(rows) == len(procs) else 0)
            if p.is_alive():
                p.terminate()
    rows.sort(key=lambda r: r["rank"])
    summary = {}
    for name in rows[0]["phases"]:
        ph = [r["phases"][name] for r in rows if name in r["phases"]]
        texts, wall = sum(p["texts"] for p in ph), max(p["wall_s"] for p in ph)
        summary[name] = {"procs": len(ph), "texts_per_s": round(texts / wall, 1),
                         "cpu_us_per_text": round(sum(p["cpu_s"] for p in ph) * 1e6 / texts, 1),
                         "stage_us_per_text_rank0": ph[0]["stage_us_per_text"]}
        begin, end = ph[0]["epoch"]
        busy = [u for t, u in samples if begin <= t <= end]
        summary[name]["gpu_busy_mean"] = round(sum(busy) / len(busy), 1) if busy else None
    out = {"args": vars(args), "summary": summary, "rows": rows, "gpu_samples": samples}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "host_probe.json").write_text(json.dumps(out, indent=1))
    for name, row in summary.items():
        print(name, json.dumps(row))
    print(rows[0].get("threads"))
    print(rows[0].get("profile", "")[:3500])


if __name__ == "__main__":
    sys.exit(main())
