"""Reranking served end to end against sentence-transformers' CrossEncoder.predict in-process.

    python -m bench.rerank [--seconds 10] [--out bench/results]

No cross-encoder ships on PyPI, so the model is MiniLM-sized and labelled as such: the default
model's all-MiniLM-L6-v2 encoder (6 layers, 384 wide: the shape of ms-marco-MiniLM-L-6-v2) under
a random one-label classification head, saved as sentence-transformers saves a CrossEncoder. Its
scores mean nothing; its cost is a real MiniLM cross-encoder's.

1. The machine: the CPU's model and flags, threads, torch.
2. Pairs: 64 queries of 8-32 tokens, each against 20 documents of the mixed corpus (4-256
   tokens, median 36): 1,280 pairs.
3. In-process: CrossEncoder.predict on those pairs as its users call it (batches of 32, fp32,
   all the machine's threads), the best of 2 runs: pairs/s.
4. Served: the model built by build_mar with no options but the model (`make serve`'s defaults:
   fp32 ONNX Runtime, 2 workers on 2 cores), its /rerank called with one query and 20 documents a
   request, at 64 clients and at one client (the median of 3 runs each): pairs/s and latency.
5. Its scores against CrossEncoder.predict's on 256 pairs: the largest difference, and whether
   each query's ranking is the same.
Results go to `<out>/rerank.json`, targets checked at the end. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
import torch

from bench.serving import serve_model
from bench.load import run_load
from embedserve.archive.corpus import load_tokenizer, mixed_corpus
from embedserve.archive.default_model import fetch_default_model
from embedserve.handler.worker.cpu_features import describe_cpu

REPO = Path(__file__).resolve().parent.parent
NAME = "reranker"
DOCUMENTS_PER_REQUEST = 20
QUERIES = 64
CLIENTS = (64, 1)
REPEATS = 3
WARMUP_S = {64: 10.0, 1: 10.0}
SPEEDUP_GOAL = 1.3
MAX_SCORE_DIFFERENCE = 1e-4


def make_cross_encoder(target: Path, seed: int = 0) -> Path:
    """all-MiniLM-L6-v2's encoder under a random one-label head, saved as a CrossEncoder."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel

    source = fetch_default_model()
    torch.manual_seed(seed)
    config = BertConfig.from_pretrained(source, num_labels=1)
    model = BertForSequenceClassification(config)
    model.bert.load_state_dict(BertModel.from_pretrained(source).state_dict(), strict=False)  # the pooler stays random
    raw = target.parent / f".{target.name}-hf"
    model.eval().save_pretrained(raw)
    AutoTokenizer.from_pretrained(source).save_pretrained(raw)
    CrossEncoder(str(raw)).save(str(target))
    return target


def pairs_corpus(tokenizer_file: Path, seed: int = 0) -> tuple[list[str], list[list[str]]]:
    """QUERIES queries of 8-32 tokens, each with DOCUMENTS_PER_REQUEST documents of the mixed corpus."""
    tokenizer = load_tokenizer(tokenizer_file)
    texts = mixed_corpus(tokenizer_file, 4096, seed=seed)
    lengths = [len(tokenizer.encode(text).ids) for text in texts]
    queries = [text for text, length in zip(texts, lengths) if 8 <= length <= 32][:QUERIES]
    rng = random.Random(seed)
    documents = [rng.sample(texts, DOCUMENTS_PER_REQUEST) for _ in queries]
    return queries, documents


def in_process(model_dir: Path, queries: list[str], documents: list[list[str]], threads: int) -> dict:
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(threads)
    model = CrossEncoder(str(model_dir), device="cpu")
    pairs = [(query, document) for query, docs in zip(queries, documents) for document in docs]
    model.predict(pairs[:32], batch_size=32)
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        model.predict(pairs, batch_size=32)
        best = min(best, time.perf_counter() - started)
    return {"pairs": len(pairs), "threads": threads, "pairs_per_s": round(len(pairs) / best, 1)}


def served(model_dir: Path, queries: list[str], documents: list[list[str]], seconds: float) -> dict:
    """The default build of the model on a TorchServe of its own: load runs, and its scores."""
    with serve_model(model_dir, NAME, "the reranker") as server:
        url = f"{server.url('inference')}/predictions/{NAME}/1.0/rerank"
        auth = server.auth()
        info = requests.get(url.rsplit("/", 1)[0] + "/info", headers=auth, timeout=60).json()
        rows = {}
        # Each request is one query and its documents: the load cuts the flat list of
        # documents 20 at a time, query by query, and the body puts the query back.
        flat = [document for docs in documents for document in docs]
        query_of = {tuple(docs): query for query, docs in zip(queries, documents)}
        load = dict(texts=flat, token_counts=[1] * len(flat), texts_per_request=DOCUMENTS_PER_REQUEST,
                    body=lambda batch: {"query": query_of[tuple(batch)], "texts": batch})
        for clients in CLIENTS:
            run_load(url, auth, concurrency=clients, seconds=WARMUP_S[clients], **load)
            runs = [run_load(url, auth, concurrency=clients, seconds=seconds, **load).summary()
                    for _ in range(REPEATS)]
            speeds = [run["texts_per_s"] for run in runs]  # a text is one (query, document) pair here
            median = dict(sorted(runs, key=lambda run: run["texts_per_s"])[len(runs) // 2])
            rows[clients] = {**median, "pairs_per_s": median.pop("texts_per_s"), "runs_pairs_per_s": speeds}
            rows[clients].pop("tokens_per_s", None)  # the load counts pairs, not tokens
            print(f"served, {clients} clients: {rows[clients]['pairs_per_s']} pairs/s, "
                  f"p50 {rows[clients]['p50_ms']} ms", file=sys.stderr)
        scores = {query: requests.post(url, json={"query": query, "texts": docs}, headers=auth, timeout=120).json()
                  for query, docs in zip(queries, documents)}
        return {"engine": info["engine"], "model_dtype": info["model_dtype"], "by_clients": rows,
                "scores": scores}


def agreement(model_dir: Path, queries: list[str], documents: list[list[str]], scores: dict) -> dict:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(model_dir), device="cpu")
    worst, same = 0.0, 0
    for query, docs in zip(queries, documents):
        want = model.predict([(query, document) for document in docs])
        got = np.zeros(len(docs))
        for item in scores[query]:
            got[item["index"]] = item["score"]
        worst = max(worst, float(np.abs(got - want).max()))
        same += [item["index"] for item in scores[query]] == list(np.argsort(-want, kind="stable"))
    return {"pairs": sum(map(len, documents)), "max_score_difference": worst, "queries_ranked_the_same": same,
            "queries": len(queries)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.rerank", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per load run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    results = measure(args.seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rerank.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["targets"], indent=2))
    print(f"wrote {args.out / 'rerank.json'}", file=sys.stderr)
    return 0


def measure(seconds: float) -> dict:
    threads = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-rerank-model-") as tmp:
        model_dir = make_cross_encoder(Path(tmp) / "minilm-cross-encoder")
        queries, documents = pairs_corpus(fetch_default_model() / "tokenizer.json")
        print("in-process CrossEncoder.predict ...", file=sys.stderr)
        reference = in_process(model_dir, queries, documents, threads)
        print("served ...", file=sys.stderr)
        serving = served(model_dir, queries, documents, seconds)
        checked = agreement(model_dir, queries, documents, serving.pop("scores"))
    results = {
        "machine": {"cpu": describe_cpu(), "threads": threads, "torch": torch.__version__},
        "model": "all-MiniLM-L6-v2's encoder under a random one-label head (the ms-marco-MiniLM-L-6-v2 shape); "
                 "no cross-encoder ships on PyPI",
        "documents_per_request": DOCUMENTS_PER_REQUEST,
        "in_process_cross_encoder": reference,
        "served": serving,
        "agreement": checked,
    }
    results["targets"] = targets(results)
    return results


def targets(results: dict) -> list[dict]:
    served_64 = results["served"]["by_clients"][64]["pairs_per_s"]
    reference = results["in_process_cross_encoder"]["pairs_per_s"]
    checked = results["agreement"]
    return [
        {"target": f"served rerank at 64 clients >= {SPEEDUP_GOAL}x CrossEncoder.predict in-process (pairs/s)",
         "measured": f"{served_64} / {reference} = {served_64 / reference:.2f}x",
         "met": served_64 >= SPEEDUP_GOAL * reference},
        {"target": "one client, 20 documents a request: p50 reported",
         "measured": f"{results['served']['by_clients'][1]['p50_ms']} ms", "met": True},
        {"target": f"scores within {MAX_SCORE_DIFFERENCE} of CrossEncoder.predict, rankings identical",
         "measured": f"max difference {checked['max_score_difference']:.1e}, "
                     f"{checked['queries_ranked_the_same']}/{checked['queries']} rankings the same",
         "met": checked["max_score_difference"] <= MAX_SCORE_DIFFERENCE
         and checked["queries_ranked_the_same"] == checked["queries"]},
    ]


if __name__ == "__main__":
    sys.exit(main())
