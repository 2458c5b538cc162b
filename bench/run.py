"""The benchmark: our engine and server against sentence-transformers, in one run.

    python -m bench.run [--seconds 10] [--out bench/results]

1. In-process, same model, corpus and threads: sentence-transformers `encode` (fp32, and cast to
   bf16) vs our engine (fp32 as served, on ONNX Runtime, and int8), with padding efficiency and
   cosine to the fp32 reference; and the batch planner on 32-text batches, least-cost cuts
   against passes filled to the token budget.
2. The CPU kernels: the forward pass engine by engine (bench/cpu_kernels.py); packed against
   padded passes (bench/packed.py).
3. The CPU's fp32 matrix-multiply rate, and from it the fixed corpus's texts/s ceiling.
4. End to end through the real TorchServe: a closed-loop client at several concurrencies and
   texts per request, on the fixed (64-token) and mixed (4-256 token) corpora; then int8; then
   int8 against fp32 with both served at once, in turns; then fp32 again with CPU lending
   between workers off, and with the torch engine. Each server is first warmed up at 64 clients
   and at one client, those it is measured at (bench/load.py); the target shapes (1 and 64
   clients, 1 text per request) are the median of 3 runs (bench/serving.py).
5. `max_batch_delay` at 1, 4, 16 and 64 clients (bench/batch_delay.py), and the per-request
   path: the handler on a near-free model against a no-op handler (bench/request_path.py).
6. The CPU's bf16 matrix units: the default build (bf16 where a start-up trial finds it
   faster) against the float32 build and bf16 sentence-transformers (bench/cpu_bf16.py).
The CPU's model and flags are recorded with the figures (they decide what bf16 can do).
Results go to `<out>/bench.json` and `<out>/bench.png`; the targets are checked at the end.
The load generator runs on the same cores as the server, as any single-machine test does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from embedserve.archive.corpus import fixed_corpus, load_tokenizer, mixed_corpus
from embedserve.archive.default_model import fetch_default_model
from embedserve.archive.int8_calibration import calibrate
from embedserve.handler.worker.cpu_features import describe_cpu
from bench import batch_delay, cpu_bf16, hybrid, packed, request_path, rerank, sparse
from bench.cpu_kernels import compare_engines, exported_copy, int8_copy
from bench.inprocess import (
    bench_engine, bench_planner, bench_sentence_transformers, cosine_stats, flops_per_token, load_engine,
    matmul_gflops,
)
from bench.load import WARMUP_SECONDS, run_load, warm_up
from bench.serving import end_to_end, serve_build

REPO = Path(__file__).resolve().parent.parent
CONCURRENCIES = (1, 4, 16, 64)
TEXTS_PER_REQUEST = (1, 32)
FIXED_LENGTH = 64
# int8 against fp32: rounds of one run of each, both servers up (_int8_against_fp32).
INT8_ROUNDS = 3
DEFAULT_DELAY_MS = 1  # the build's --max-batch-delay default
OTHER_DELAYS_MS = (10,)  # swept beside the default (bench/batch_delay.py)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per load run")
    parser.add_argument("--corpus-size", type=int, default=512, help="texts per in-process corpus")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)

    model_dir = fetch_default_model()
    threads = os.cpu_count() or 1
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    corpora = {
        "fixed": fixed_corpus(model_dir / "tokenizer.json", 2048, FIXED_LENGTH),
        "mixed": mixed_corpus(model_dir / "tokenizer.json", 2048),
    }
    tokens = {name: [len(tokenizer.encode(t).ids) for t in texts] for name, texts in corpora.items()}
    results: dict = {"machine": _machine(threads), "in_process": {}, "end_to_end": {}}

    print(f"in-process, {threads} threads, {args.corpus_size} texts per corpus ...", file=sys.stderr)
    scratch = tempfile.TemporaryDirectory(prefix="bench-model-")
    fp32 = load_engine(exported_copy(model_dir, Path(scratch.name)), threads)  # as served: ONNX Runtime
    # What `build_mar.sh --dtype int8` ships (ONNX Runtime), and builds with --set engine=torch.
    int8_dir, calibration = int8_copy(model_dir, Path(scratch.name))
    torch_calibration = calibrate(model_dir, {})
    results["int8_calibration"] = {done.engine: {"kept_fp32": done.keep_fp32, "quantized": done.quantized}
                                   for done in (calibration, torch_calibration)}
    int8 = load_engine(int8_dir, threads, dtype="int8")
    references = {}
    for name, texts in corpora.items():
        sample = texts[: args.corpus_size]
        st, reference = bench_sentence_transformers(model_dir, sample, threads)
        st_bf16, vectors_bf16 = bench_sentence_transformers(model_dir, sample, threads, dtype=torch.bfloat16)
        references[name] = reference
        ours, vectors = bench_engine(fp32, sample)
        ours_int8, vectors_int8 = bench_engine(int8, sample)
        results["in_process"][name] = {
            "sentence_transformers": st,
            "sentence_transformers_bf16": {**st_bf16, **cosine_stats(vectors_bf16, reference)},
            "ours_fp32": {**ours, **cosine_stats(vectors, reference)},
            "ours_int8": {**ours_int8, **cosine_stats(vectors_int8, vectors)},
        }

    # The batch planner on batches of 32 mixed texts, one per request as at 64 clients.
    results["planner"] = bench_planner(fp32, corpora["mixed"][: args.corpus_size])

    print("CPU kernels ...", file=sys.stderr)
    results["cpu_kernels"] = compare_engines(model_dir, corpora["mixed"][:256], references["mixed"][:256], threads,
                                             torch_calibration.keep_fp32, int8_dir)
    print("packed passes ...", file=sys.stderr)
    results["packed"] = packed.compare_engines(model_dir, corpora["mixed"][:256], rounds=2)
    gflops = matmul_gflops(threads)
    per_text = flops_per_token(load_engine(model_dir, threads), FIXED_LENGTH) * FIXED_LENGTH  # torch
    results["matmul"] = {"gflops": round(gflops, 1), "mflop_per_token": round(per_text / FIXED_LENGTH / 1e6, 2),
                         "fixed_texts_per_s_limit": round(gflops * 1e9 / per_text, 1)}
    del fp32, int8
    scratch.cleanup()

    for dtype in ("float32", "int8"):
        scenarios = _scenarios() if dtype == "float32" else [("mixed", 64, 1), ("fixed", 64, 1)]
        results["end_to_end"][dtype] = end_to_end(dtype, corpora, tokens, scenarios, args.seconds)
    results["int8_against_float32"] = _int8_against_fp32(corpora, tokens, args.seconds)
    # The same fp32 server with workers that never lend each other idle CPUs.
    results["end_to_end"]["float32_no_lending"] = end_to_end(
        "float32", corpora, tokens, [("mixed", c, 1) for c in CONCURRENCIES], args.seconds,
        settings=["lend_idle_cpus=false"])
    # The same fp32 server on the torch engine: what ONNX Runtime changed end to end.
    results["end_to_end"]["float32_torch"] = end_to_end(
        "float32", corpora, tokens, [(corpus, c, 1) for corpus in ("mixed", "fixed") for c in (1, 64)], args.seconds,
        settings=["engine=torch"])
    print("max_batch_delay sweep ...", file=sys.stderr)
    results["batch_delay"] = batch_delay.sweep(list(OTHER_DELAYS_MS), args.seconds, corpora, tokens) + [
        {"max_batch_delay_ms": DEFAULT_DELAY_MS, **row} for row in results["end_to_end"]["float32"]
        if row["texts_per_request"] == 1]
    print("request path ...", file=sys.stderr)
    results["request_path"] = request_path.measure(args.seconds, clients=64)
    print("CPU bf16: the default build against the float32 build ...", file=sys.stderr)
    results["cpu_bf16"] = cpu_bf16.measure(model_dir, corpora, tokens, args.seconds, args.corpus_size)

    print("rerank: a MiniLM-sized cross-encoder served against CrossEncoder.predict ...", file=sys.stderr)
    results["rerank"] = rerank.measure(args.seconds)
    print("sparse: a MiniLM-sized SPLADE model served against SparseEncoder.encode ...", file=sys.stderr)
    results["sparse"] = sparse.measure(args.seconds)
    print("hybrid: a MiniLM-sized bge-m3 served against FlagEmbedding's M3Embedder.encode ...", file=sys.stderr)
    results["hybrid"] = hybrid.measure(args.seconds)

    results["targets"] = check_targets(results) + results["cpu_bf16"]["targets"] + results["rerank"]["targets"] \
        + results["sparse"]["targets"] + results["hybrid"]["targets"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=2))
    from bench.plot import plot

    plot(results, args.out / "bench.png")
    print(json.dumps(results["targets"], indent=2))
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.png'}", file=sys.stderr)
    return 0


def _scenarios() -> list[tuple[str, int, int]]:
    return [(corpus, c, n) for corpus in ("fixed", "mixed") for n in TEXTS_PER_REQUEST for c in CONCURRENCIES]


def _int8_against_fp32(corpora: dict, tokens: dict, seconds: float, rounds: int = INT8_ROUNDS) -> dict:
    """int8 against fp32 end to end, minute by minute: both builds served at once (the idle one
    only waits), a run of each in turn per round at 64 clients, one mixed text per request.
    Servers measured minutes apart drift apart with the shared machine; runs side by side do not."""
    texts_per_s: dict[str, list[float]] = {"float32": [], "int8": []}
    with serve_build("float32", corpora, tokens, {64}) as fp32, serve_build("int8", corpora, tokens, {64}) as int8:
        # Warm again: the fp32 server idled while the int8 one was built and warmed up.
        warm_up(*fp32, corpora["mixed"], tokens["mixed"], seconds={64: WARMUP_SECONDS[64]})
        for round_ in range(rounds):
            for dtype, (url, auth) in (("float32", fp32), ("int8", int8)):
                print(f"int8 against fp32, round {round_ + 1}: {dtype} ...", file=sys.stderr)
                run = run_load(url, auth, corpora["mixed"], tokens["mixed"], concurrency=64, texts_per_request=1,
                               seconds=seconds).summary()
                texts_per_s[dtype].append(run["texts_per_s"])
                time.sleep(1.0)
    ratios = [round(b / a, 3) for a, b in zip(texts_per_s["float32"], texts_per_s["int8"])]
    return {"corpus": "mixed", "concurrency": 64, "texts_per_request": 1, "texts_per_s": texts_per_s,
            "ratios": ratios, "median_ratio": sorted(ratios)[len(ratios) // 2]}


def _row(rows: list[dict], corpus: str, concurrency: int, per_request: int) -> dict:
    return next(r for r in rows if (r["corpus"], r["concurrency"], r["texts_per_request"]) ==
                (corpus, concurrency, per_request))


def check_targets(results: dict) -> list[dict]:
    fp32, int8 = results["end_to_end"]["float32"], results["end_to_end"]["int8"]
    st_mixed = results["in_process"]["mixed"]["sentence_transformers"]["texts_per_s"]
    mixed64 = _row(fp32, "mixed", 64, 1)["texts_per_s"]
    fixed64 = _row(fp32, "fixed", 64, 1)["texts_per_s"]
    limit = results["matmul"]["fixed_texts_per_s_limit"]
    int8_mixed64 = _row(int8, "mixed", 64, 1)["texts_per_s"]
    int8_ratio = results["int8_against_float32"]["median_ratio"]
    int8_quality = results["in_process"]["mixed"]["ours_int8"]
    idle, idle_fixed = _row(fp32, "mixed", 1, 1), _row(fp32, "fixed", 1, 1)
    path = results["request_path"]
    return [
        _target("end to end vs sentence-transformers in-process (mixed, 64 clients, 1 text)",
                round(mixed64 / st_mixed, 2), ">= 1.3", mixed64 / st_mixed >= 1.3),
        _target("the same with the int8 build", round(int8_mixed64 / st_mixed, 2), ">= 1.3",
                int8_mixed64 / st_mixed >= 1.3),
        _target("fixed 64-token texts/s end to end (64 clients, 1 text)", fixed64, ">= 80", fixed64 >= 80),
        _target("fixed end to end / matmul limit", round(fixed64 / limit, 2), ">= 0.78", fixed64 / limit >= 0.78),
        _target("int8 / fp32 end to end (mixed, 64 clients; median of rounds side by side)", round(int8_ratio, 2),
                ">= 1.4", int8_ratio >= 1.4),
        _target("int8 cosine to fp32 (mean, min)", [int8_quality["mean_cosine"], int8_quality["min_cosine"]],
                ">= 0.99, >= 0.97", int8_quality["mean_cosine"] >= 0.99 and int8_quality["min_cosine"] >= 0.97),
        _target("1 client, 1 mixed text: p50, p99 (ms)", [idle["p50_ms"], idle["p99_ms"]], "<= 20, <= 60",
                idle["p50_ms"] <= 20 and idle["p99_ms"] <= 60),
        _target("1 client, 1 fixed 64-token text: p50 (ms)", idle_fixed["p50_ms"], "<= 20", idle_fixed["p50_ms"] <= 20),
        _target("request path: tiny model / no-op handler, requests/s at 64 clients", path["ratio"], ">= 0.75",
                path["ratio"] >= 0.75),
        _target("packed / padded passes, torch, in-process (mixed)", results["packed"]["packed_over_padded_torch"],
                ">= 1.0", results["packed"]["packed_over_padded_torch"] >= 1.0),
        _target("packed torch / the CPU default (ONNX Runtime, padded), in-process (mixed); the default "
                "stays padded below 1.0", results["packed"]["packed_over_onnxruntime"], ">= 1.0",
                results["packed"]["packed_over_onnxruntime"] >= 1.0),
    ]


def _target(name: str, measured, goal: str, met: bool) -> dict:
    return {"target": name, "measured": measured, "goal": goal, "met": bool(met)}


def _machine(threads: int) -> dict:
    return {"cpu": describe_cpu(), "cpu_threads": threads, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


if __name__ == "__main__":
    sys.exit(main())
