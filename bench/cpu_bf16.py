"""The CPU's matrix units: bf16 chosen by measurement, measured in one run.

    python -m bench.cpu_bf16 [--seconds 10] [--out bench/results]

A CPU worker whose CPU has bf16 matrix units (AMX, AVX-512 bf16) times float32 ONNX Runtime
against the bf16 engines at start-up and serves the fastest; on any other CPU it serves float32
untried. This measures what the default build gains from that choice and what it costs:

1. The machine: the CPU's model and flags (those the choice turns on), threads, torch.
2. In-process, same corpus (512 mixed texts) and threads: sentence-transformers `encode` in fp32
   and cast to bf16, with the bf16 vectors' cosine to the fp32 ones. bf16 sentence-transformers
   is what a user with these units gets in one line, so it is the baseline to beat.
3. End to end through the real TorchServe: the default build (`--dtype auto`) and the float32
   build, at 64 clients and at one client on mixed texts, and at one client on fixed 64-token
   texts (bench/serving.py: warmed up, target shapes the median of 3 runs). Each build's /info
   is kept with its figures: the dtype and engine it served, why, and the speeds it measured.
4. Each build's served vectors for 256 mixed texts against sentence-transformers fp32.
5. Each build's start-up, from the server's start to its first embedding: the trial is in it.
Results go to `<out>/cpu_bf16.json`, targets checked at the end; bench/run.py runs the same as
one of its sections. About 10 minutes on 2 cores at the default 10 s per load run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import requests
import torch

from embedserve.archive.corpus import fixed_corpus, load_tokenizer, mixed_corpus
from embedserve.archive.default_model import fetch_default_model
from embedserve.handler.worker.cpu_features import describe_cpu
from bench.inprocess import bench_sentence_transformers, cosine_stats
from bench.serving import run_scenarios, serve_build

REPO = Path(__file__).resolve().parent.parent
CORPUS_SIZE = 512  # in-process texts: the first of the mixed corpus, mixed_corpus(..., 512)'s texts
COSINE_TEXTS = 256
FIXED_LENGTH = 64
SCENARIOS = [("mixed", 64, 1), ("mixed", 1, 1), ("fixed", 1, 1)]
# The build's default (the worker's choice) and the float32 build it must never lose to.
BUILDS = ("auto", "float32")
MODEL_VERSION = "1.0"  # the build's default, in the /info URL
# What /info says about the engine served; keys naming a measured speed are kept as well.
INFO_KEYS = ("model_dtype", "engine", "device", "selected_by")
SPEED_WORDS = ("speed", "per_second", "trial", "measured")
STARTUP_SLACK_S = 30.0  # what the trial may add to a worker's start-up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.cpu_bf16", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per load run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)

    model_dir = fetch_default_model()
    corpora, tokens = load_corpora(model_dir)
    results = measure(model_dir, corpora, tokens, args.seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_bf16.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["targets"], indent=2))
    print(f"wrote {args.out / 'cpu_bf16.json'}", file=sys.stderr)
    return 0


def load_corpora(model_dir: Path) -> tuple[dict, dict]:
    """bench/run.py's corpora, 2048 texts each for the load generator, and their token counts."""
    tokenizer_file = model_dir / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_file)
    corpora = {"fixed": fixed_corpus(tokenizer_file, 2048, FIXED_LENGTH), "mixed": mixed_corpus(tokenizer_file, 2048)}
    tokens = {name: [len(tokenizer.encode(t).ids) for t in texts] for name, texts in corpora.items()}
    return corpora, tokens


def measure(model_dir: Path, corpora: dict, tokens: dict, seconds: float, corpus_size: int = CORPUS_SIZE) -> dict:
    """Everything in one stretch of the (possibly shared) machine, so the ratios compare like with like."""
    threads = os.cpu_count() or 1
    results: dict = {"machine": machine(threads)}
    print(f"cpu bf16: {results['machine']['cpu']['model_name']}, bf16 units: "
          f"{results['machine']['cpu']['bf16_units']}; sentence-transformers fp32 and bf16 ...", file=sys.stderr)
    sample, load = corpora["mixed"][:corpus_size], load_average()
    fp32, reference = bench_sentence_transformers(model_dir, sample, threads)
    bf16, vectors = bench_sentence_transformers(model_dir, sample, threads, dtype=torch.bfloat16)
    results["in_process"] = {"corpus": "mixed", "texts": len(sample), "threads": threads, "load_average": load,
                             "sentence_transformers": fp32,
                             "sentence_transformers_bf16": {**bf16, **cosine_stats(vectors, reference)}}
    results["served"] = {dtype: serve(dtype, corpora, tokens, seconds, sample[:COSINE_TEXTS],
                                      reference[:COSINE_TEXTS]) for dtype in BUILDS}
    results["targets"] = check_targets(results)
    return results


def machine(threads: int) -> dict:
    return {"cpu": describe_cpu(), "cpu_threads": threads, "torch": torch.__version__,
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def load_average() -> list[float]:
    """Recorded before each part: the ratios compare parts measured minutes apart, and on a
    shared machine a neighbour's load in one of them skews them (sentence-transformers ran at a
    quarter of its speed once, with the load average at 2 on 2 cores)."""
    return [round(x, 2) for x in os.getloadavg()]


def serve(dtype: str, corpora: dict, tokens: dict, seconds: float, texts: Sequence[str],
          reference: np.ndarray) -> dict:
    """One build on one server: its start-up, its /info, its vectors' cosine to `reference`,
    then the scenarios."""
    timings: dict = {"load_average": load_average()}
    with serve_build(dtype, corpora, tokens, {c for _, c, _ in SCENARIOS}, timings=timings) as (url, auth):
        response = requests.get(f"{url}/{MODEL_VERSION}/info", headers=auth, timeout=30)
        response.raise_for_status()
        quality = cosine_stats(embed(url, auth, texts), reference)
        rows = run_scenarios(dtype, url, auth, corpora, tokens, SCENARIOS, seconds)
    return {**timings, "info": engine_info(response.json()), "cosine_to_st_fp32": quality, "end_to_end": rows}


def engine_info(info: dict) -> dict:
    """/info's account of how the build runs: dtype, engine, why, and any speed it measured
    (the engine trial's, the warm-up's), so the figures say which engine earned them."""
    return {key: value for key, value in info.items()
            if key in INFO_KEYS or any(word in key for word in SPEED_WORDS)}


def embed(url: str, auth: dict, texts: Sequence[str], per_request: int = 32) -> np.ndarray:
    """The served vectors for `texts`, in order, through the native route: {"input": [...]}
    answered in the OpenAI list shape."""
    vectors: list[list[float]] = []
    for start in range(0, len(texts), per_request):
        response = requests.post(url, json={"input": list(texts[start : start + per_request])}, headers=auth,
                                 timeout=120)
        response.raise_for_status()
        vectors += [d["embedding"] for d in sorted(response.json()["data"], key=lambda d: d["index"])]
    return np.asarray(vectors, dtype=np.float32)


def check_targets(results: dict) -> list[dict]:
    """With bf16 units the default build must beat bf16 sentence-transformers by 1.3x, answer
    an idle 64-token request in 6 ms and keep fp32's vectors; without them (no trial, float32
    served) it must not fall behind the float32 build. Either way the trial costs at most
    STARTUP_SLACK_S of start-up."""
    default, fp32 = results["served"]["auto"], results["served"]["float32"]
    mixed64 = _row(default["end_to_end"], "mixed", 64, 1)["texts_per_s"]
    most = round(fp32["startup_s"] + STARTUP_SLACK_S, 1)
    startup = _target("default build start-up, server start to first embedding (s)", default["startup_s"],
                      f"<= float32 build's + {STARTUP_SLACK_S:.0f} = {most}", default["startup_s"] <= most)
    if results["machine"]["cpu"]["bf16_units"] is None:
        ratio = mixed64 / _row(fp32["end_to_end"], "mixed", 64, 1)["texts_per_s"]
        return [_target("no bf16 units: default / float32 build end to end (mixed, 64 clients, 1 text)",
                        round(ratio, 2), ">= 0.95", ratio >= 0.95), startup]
    st_bf16 = results["in_process"]["sentence_transformers_bf16"]["texts_per_s"]
    fixed1 = _row(default["end_to_end"], "fixed", 1, 1)["p50_ms"]
    min_cosine = default["cosine_to_st_fp32"]["min_cosine"]
    return [
        _target("default build end to end / sentence-transformers bf16 in-process (mixed, 64 clients, 1 text)",
                round(mixed64 / st_bf16, 2), ">= 1.3", mixed64 / st_bf16 >= 1.3),
        _target("default build, 1 client, 1 fixed 64-token text: p50 (ms)", fixed1, "<= 6", fixed1 <= 6),
        _target("default build's served vectors: min cosine to sentence-transformers fp32", min_cosine, ">= 0.999",
                min_cosine >= 0.999),
        startup,
    ]


def _row(rows: list[dict], corpus: str, concurrency: int, per_request: int) -> dict:
    return next(r for r in rows if (r["corpus"], r["concurrency"], r["texts_per_request"]) ==
                (corpus, concurrency, per_request))


def _target(name: str, measured, goal: str, met: bool) -> dict:
    return {"target": name, "measured": measured, "goal": goal, "met": bool(met)}


if __name__ == "__main__":
    sys.exit(main())
