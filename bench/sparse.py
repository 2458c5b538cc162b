"""Sparse (SPLADE) embeddings served end to end against sentence-transformers' SparseEncoder.encode in-process.

    python -m bench.sparse [--seconds 10] [--out bench/results]

No SPLADE model ships on PyPI, so the model is MiniLM-sized and labelled as such: the default
model's all-MiniLM-L6-v2 encoder (6 layers, 384 wide) under its BERT vocabulary (30,522) with a
masked-language head, saved as sentence-transformers saves a SparseEncoder (a fill-mask
Transformer, then SpladePooling(max, relu)). The head is random, its output bias far below zero
but on ACTIVE random ids, so each vector has a trained SPLADE model's few hundred entries. Its
weights mean nothing; its cost is a real MiniLM SPLADE model's, the 30k-wide head included.

1. The machine: the CPU's model and flags, threads, torch.
2. Texts: 256 of the mixed corpus (4-256 tokens, median 39).
3. In-process: SparseEncoder.encode on them as its users call it (batches of 32, fp32, all the
   machine's threads), the best of 2 runs: texts/s, CPU time a text, the process's peak RSS growth.
4. Served: the model built by build_mar with no options but the model (`make serve`'s defaults),
   TEI's /embed_sparse called with one text a request, at 64 clients and at one client (the
   median of 3 runs each): texts/s and latency, and TorchServe's CPU time a text (frontend and
   workers: on a shared machine, a figure other processes' load does not inflate as much).
5. Its vectors against SparseEncoder.encode's on 256 texts: the same non-zero ids, and the
   largest weight difference.
6. The served pooler's memory: embedserve's SpladePooler run in-process on one pass of 64 inputs
   of 256 tokens, its peak RSS growth against its CHUNK_VALUES block and against the
   (batch, seq, vocabulary) logits sentence-transformers' SpladePooling holds at once.
Results go to `<out>/sparse.json`, targets checked at the end. About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
import torch

from bench.serving import serve_model, server_cpu_seconds
from bench.load import run_load
from embedserve.archive.corpus import load_tokenizer, mixed_corpus
from embedserve.archive.default_model import fetch_default_model
from embedserve.handler.worker.cpu_features import describe_cpu
from embedserve.scripts.serverctl import TorchServe

REPO = Path(__file__).resolve().parent.parent
NAME = "splade"
ACTIVE = 300  # vocabulary ids a text can activate: a trained SPLADE model keeps a few hundred
TEXTS = 256
CHECKED = 256
TEXTS_PER_REQUEST = 1
CLIENTS = (64, 1)
REPEATS = 3
WARMUP_S = {64: 10.0, 1: 10.0}
POOLER_PASS = (64, 256)  # inputs, tokens: the pass whose pooling memory is measured
SPEEDUP_GOAL = 1.3
# The pooler's peak: the block being pooled, the one before it until it is replaced, the result.
POOLER_BLOCKS_GOAL = 3
MAX_WEIGHT_DIFFERENCE = 1e-4
MIB = 1 << 20


def make_splade(target: Path, seed: int = 0) -> Path:
    """all-MiniLM-L6-v2's encoder under a random masked-language head, saved as a SparseEncoder."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

    source = fetch_default_model()
    torch.manual_seed(seed)
    config = BertConfig.from_pretrained(source)
    model = BertForMaskedLM(config)  # its decoder is tied to the word embeddings loaded below
    missing, _ = model.bert.load_state_dict(BertModel.from_pretrained(source).state_dict(), strict=False)
    assert not missing, missing  # every encoder weight is MiniLM's (its unused pooler is left out)
    with torch.no_grad():
        bias = model.cls.predictions.bias
        active = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))[:ACTIVE]
        bias.fill_(-30.0)
        bias[active] = 0.0
    raw = target.parent / f".{target.name}-hf"
    model.eval().save_pretrained(raw)
    AutoTokenizer.from_pretrained(source).save_pretrained(raw)
    transformer = Transformer(str(raw), transformer_task="fill-mask", max_seq_length=256)
    SparseEncoder(modules=[transformer, SpladePooling(pooling_strategy="max", activation_function="relu")],
                  device="cpu").save(str(target))
    return target


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_rss_growth(work) -> tuple[object, float]:
    """`work()`'s result and how far the process's RSS rose above where it started, in MiB (the
    high-water mark reset first, through /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    result = work()
    return result, round((_status_kib("VmHWM") - before) / 1024, 1)


def in_process(model_dir: Path, texts: list[str], threads: int) -> tuple[dict, torch.Tensor]:
    """SparseEncoder.encode's speed and peak RSS growth, and its (sparse) vectors of `texts`."""
    from sentence_transformers import SparseEncoder

    torch.set_num_threads(threads)
    model = SparseEncoder(str(model_dir), device="cpu", local_files_only=True)
    model.encode(texts[:32], batch_size=32)
    best, cpu, growth = float("inf"), 0.0, 0.0
    for _ in range(2):
        started, cpu_started = time.perf_counter(), time.process_time()
        vectors, grown = peak_rss_growth(lambda: model.encode(texts, batch_size=32))
        elapsed = time.perf_counter() - started
        if elapsed < best:
            best, cpu = elapsed, time.process_time() - cpu_started
        growth = max(growth, grown)
    return {"texts": len(texts), "threads": threads, "texts_per_s": round(len(texts) / best, 1),
            "cpu_ms_per_text": round(cpu / len(texts) * 1000, 1), "peak_rss_growth_mib": growth}, vectors


def served(model_dir: Path, texts: list[str], token_counts: list[int], seconds: float) -> dict:
    """The default build of the model on a TorchServe of its own: load runs, and its vectors."""
    with serve_model(model_dir, NAME, "the SPLADE model") as server:
        url = f"{server.url('inference')}/predictions/{NAME}/1.0/embed_sparse"
        auth = server.auth()
        info = requests.get(url.rsplit("/", 1)[0] + "/info", headers=auth, timeout=60).json()
        rows = {}
        load = dict(texts=texts, token_counts=token_counts, texts_per_request=TEXTS_PER_REQUEST,
                    body=lambda batch: {"inputs": batch})
        for clients in CLIENTS:
            run_load(url, auth, concurrency=clients, seconds=WARMUP_S[clients], **load)
            cpu_started = sum(server_cpu_seconds(server))
            loads = [run_load(url, auth, concurrency=clients, seconds=seconds, **load) for _ in range(REPEATS)]
            # The server's CPU over the runs, their uncounted first seconds included: an upper bound.
            cpu_ms = (sum(server_cpu_seconds(server)) - cpu_started) / sum(run.texts for run in loads) * 1000
            runs = [run.summary() for run in loads]
            median = dict(sorted(runs, key=lambda run: run["texts_per_s"])[len(runs) // 2])
            rows[clients] = {**median, "runs_texts_per_s": [run["texts_per_s"] for run in runs],
                             "server_cpu_ms_per_text": round(cpu_ms, 1)}
            print(f"served, {clients} clients: {median['texts_per_s']} texts/s, p50 {median['p50_ms']} ms",
                  file=sys.stderr)
        vectors = []
        for first in range(0, CHECKED, 16):
            answer = requests.post(url, json={"inputs": texts[first:first + 16]}, headers=auth, timeout=120)
            answer.raise_for_status()
            vectors += [{entry["index"]: entry["value"] for entry in row} for row in answer.json()]
        return {"engine": info.get("engine"), "model_dtype": info.get("model_dtype"),
                "workers": info.get("workers"), "by_clients": rows, "vectors": vectors}


def agreement(reference: torch.Tensor, vectors: list[dict[int, float]]) -> dict:
    """The served vectors against SparseEncoder.encode's (`reference`, one dense row each)."""
    dense = reference.numpy()
    worst, same, entries, stray = 0.0, 0, 0, 0.0
    for row, got in zip(dense, vectors, strict=True):
        want = {int(i): float(row[i]) for i in np.flatnonzero(row)}
        same += sorted(got) == sorted(want)
        entries += len(want)
        # An id one side has and the other lacks counts as a difference of its whole weight.
        worst = max([worst, *(abs(got.get(i, 0.0) - want.get(i, 0.0)) for i in set(got) | set(want))])
        stray = max([stray, *(abs(got.get(i, 0.0) - want.get(i, 0.0)) for i in set(got) ^ set(want))])
    return {"texts": len(vectors), "same_ids": same, "mean_non_zero": round(entries / len(vectors), 1),
            "max_weight_difference": worst, "largest_weight_on_differing_ids": stray}


def pooler_memory(model_dir: Path, threads: int) -> dict:
    """embedserve's SpladePooler on one (inputs, tokens) pass of token states: its peak RSS growth
    and time, against the logits of the whole pass at once."""
    from transformers import AutoModelForMaskedLM

    from embedserve.handler.model.description import SparsePooling
    from embedserve.handler.model.sparse import CHUNK_VALUES, SpladePooler, masked_lm_parts

    torch.set_num_threads(threads)
    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    vocabulary = model.config.vocab_size
    _, head = masked_lm_parts(model)
    pooler = SpladePooler(head, SparsePooling("max", "relu", vocabulary))
    inputs, tokens = POOLER_PASS
    hidden = torch.randn(inputs, tokens, model.config.hidden_size)
    mask = torch.ones(inputs, tokens, dtype=torch.int64)
    rows = max(1, min(inputs, CHUNK_VALUES // vocabulary))
    block = rows * max(1, CHUNK_VALUES // (rows * vocabulary)) * vocabulary
    with torch.inference_mode():
        pooler(hidden[:, :16], mask[:, :16])  # full-sized blocks once: the GEMM's one-time allocations
        started = time.perf_counter()
        out, growth = peak_rss_growth(lambda: pooler(hidden, mask))
        elapsed = time.perf_counter() - started
    return {"inputs": inputs, "tokens": tokens, "vocabulary": vocabulary, "seconds": round(elapsed, 2),
            "chunk_values": CHUNK_VALUES, "block_values": block, "block_mib": round(block * 4 / MIB, 1),
            "result_mib": round(out.numel() * 4 / MIB, 1), "peak_rss_growth_mib": growth,
            "whole_pass_logits_mib": round(inputs * tokens * vocabulary * 4 / MIB, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.sparse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per load run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    results = measure(args.seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sparse.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["targets"], indent=2))
    print(f"wrote {args.out / 'sparse.json'}", file=sys.stderr)
    return 0


def measure(seconds: float) -> dict:
    threads = os.cpu_count() or 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-sparse-model-") as tmp:
        model_dir = make_splade(Path(tmp) / "minilm-splade")
        tokenizer_file = fetch_default_model() / "tokenizer.json"
        texts = mixed_corpus(tokenizer_file, TEXTS)
        tokenizer = load_tokenizer(tokenizer_file)
        token_counts = [len(tokenizer.encode(text).ids) for text in texts]
        print("in-process SparseEncoder.encode ...", file=sys.stderr)
        reference, encoded = in_process(model_dir, texts, threads)
        print("the pooler's memory ...", file=sys.stderr)
        pooler = pooler_memory(model_dir, threads)
        print("served ...", file=sys.stderr)
        serving = served(model_dir, texts, token_counts, seconds)
        checked = agreement(encoded.to_dense()[:CHECKED], serving.pop("vectors"))
    results = {
        "machine": {"cpu": describe_cpu(), "threads": threads, "torch": torch.__version__,
                    # the machine is shared: its 1-minute load average when the run began and ended
                    "load_average_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "model": f"all-MiniLM-L6-v2's encoder under a random masked-language head (30,522-entry BERT vocabulary, "
                 f"output bias -30 but on {ACTIVE} random ids), SpladePooling(max, relu); no SPLADE model ships "
                 "on PyPI",
        "texts": {"corpus": "mixed", "count": TEXTS, "median_tokens": int(np.median(token_counts)),
                  "max_tokens": max(token_counts)},
        "texts_per_request": TEXTS_PER_REQUEST,
        "in_process_sparse_encoder": reference,
        "served": serving,
        "agreement": checked,
        "pooler_memory": pooler,
    }
    results["targets"] = targets(results)
    return results


def targets(results: dict) -> list[dict]:
    served_64 = results["served"]["by_clients"][64]["texts_per_s"]
    reference = results["in_process_sparse_encoder"]["texts_per_s"]
    checked, pooler = results["agreement"], results["pooler_memory"]
    inputs, tokens = POOLER_PASS
    budget = POOLER_BLOCKS_GOAL * pooler["chunk_values"] * 4 // MIB
    return [
        {"target": f"served /embed_sparse at 64 clients >= {SPEEDUP_GOAL}x SparseEncoder.encode in-process (texts/s)",
         "measured": f"{served_64} / {reference} = {served_64 / reference:.2f}x; CPU a text: served "
                     f"{results['served']['by_clients'][64]['server_cpu_ms_per_text']} ms (frontend and workers), "
                     f"in-process {results['in_process_sparse_encoder']['cpu_ms_per_text']} ms",
         "met": served_64 >= SPEEDUP_GOAL * reference},
        {"target": "one client, one text a request: p50 and p99 reported",
         "measured": f"p50 {results['served']['by_clients'][1]['p50_ms']} ms, "
                     f"p99 {results['served']['by_clients'][1]['p99_ms']} ms", "met": True},
        {"target": "the same non-zero ids as SparseEncoder.encode on every checked text",
         "measured": f"{checked['same_ids']}/{checked['texts']} texts",
         "met": checked["same_ids"] == checked["texts"]},
        {"target": f"weights within {MAX_WEIGHT_DIFFERENCE} of SparseEncoder.encode's",
         "measured": f"max difference {checked['max_weight_difference']:.1e}",
         "met": checked["max_weight_difference"] <= MAX_WEIGHT_DIFFERENCE},
        {"target": f"the pooler on a {inputs} x {tokens}-token pass: blocks of at most CHUNK_VALUES floats, peak "
                   f"RSS growth within {POOLER_BLOCKS_GOAL} x CHUNK_VALUES floats ({budget} MiB), not the pass's "
                   "logits",
         "measured": f"a block {pooler['block_mib']} MiB, peak growth {pooler['peak_rss_growth_mib']} MiB; the "
                     f"pass's logits {pooler['whole_pass_logits_mib']} MiB",
         "met": pooler["block_values"] <= pooler["chunk_values"] and pooler["peak_rss_growth_mib"] <= budget},
    ]


if __name__ == "__main__":
    sys.exit(main())
