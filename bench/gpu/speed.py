"""How fast: batch-1 latency, saturation (real tokens/s and MFU) against sentence-transformers,
packed passes against padded ones, and the engine's whole `handle` on TorchServe batches."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from embedserve.archive.corpus import load_tokenizer, text_of_length, vocabulary_words
from bench.gpu.common import ST_BATCH_SIZES, TORCHSERVE_BATCH, library_threads
from bench.inprocess import flops_per_token
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.service import EmbeddingService
from embedserve.handler.model.inputs import plain_inputs

LATENCY_TOKENS = (16, 64, 128)
# The handler's host stages (BatchReport): all its work outside the forward pass.
HOST_STAGES = ("parse", "tokenize", "encode")


def latency(engines: dict[str, EmbeddingService], model_dir: Path, repeats: int, cuda: bool) -> list[dict]:
    """One text per call through `encoder.embed` (pad, copy in, forward, pool, copy out): the
    median of `repeats` calls, by wall clock and by CUDA events around the call."""
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    words, rng = vocabulary_words(tokenizer), random.Random(3)
    rows = []
    for tokens in LATENCY_TOKENS:
        text = text_of_length(tokenizer, words, rng, tokens)
        for name, engine in engines.items():
            ids = engine.text.token_ids([text])
            rows.append({"tokens": tokens, "input_tokens": len(ids[0]), "mode": name, "repeats": repeats,
                         **one_input_latency(engine, ids, repeats, cuda)})
    return rows


def one_input_latency(engine: EmbeddingService, ids: list[list[int]], repeats: int, cuda: bool) -> dict:
    """`ids` (one input) through `encoder.embed`, `repeats` times after a warm-up of its shape:
    the median and p90 wall time, and the median time between CUDA events around the call."""
    for _ in range(max(3, repeats // 20)):  # warm this shape up
        engine.encoder.embed(plain_inputs(ids))
    wall, events = [], []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        engine.encoder.embed(plain_inputs(ids))
        wall.append((time.perf_counter() - began) * 1e3)
        if cuda:
            end.record()
            end.synchronize()
            events.append(start.elapsed_time(end))
    return {"wall_ms": round(statistics.median(wall), 4), "wall_p90_ms": round(float(np.percentile(wall, 90)), 4),
            "event_ms": round(statistics.median(events), 4) if events else None}


def saturation(engine: EmbeddingService, model_dir: Path, texts: list[str], device: str, dtype: str, best_of: int,
               peak: dict | None, with_sentence_transformers: bool = True) -> dict:
    """The whole corpus in one `embed` call (the engine sorts and cuts it), fastest of `best_of`,
    with tokenizing timed apart; then sentence-transformers `encode` on the same texts (its vectors
    under `sentence_transformers_vectors`, for the caller to compare and drop), unless told not
    to. MFU is None without a `peak`."""
    tokenize_s, embed_s = float("inf"), float("inf")
    for _ in range(best_of):
        began = time.perf_counter()
        ids = engine.text.token_ids(texts)
        tokenize_s = min(tokenize_s, time.perf_counter() - began)
        began = time.perf_counter()
        embedded = engine.encoder.embed(plain_inputs(ids))  # returns on the host: the device is done
        embed_s = min(embed_s, time.perf_counter() - began)
    lengths = np.array([len(row) for row in ids], dtype=np.float64)
    # Attention's cost per token grows with its sequence's length: weigh lengths by their tokens.
    flops = flops_per_token(engine, float((lengths**2).sum() / lengths.sum()))
    tokens_per_s = embedded.real_tokens / embed_s
    ours = {
        "texts": len(texts),
        "real_tokens": embedded.real_tokens,
        "padding_efficiency": round(embedded.real_tokens / embedded.padded_tokens, 4),
        "forward_passes": embedded.passes,
        "tokens_per_s": round(tokens_per_s, 1),
        "texts_per_s": round(len(texts) / embed_s, 1),
        "texts_per_s_with_tokenizing": round(len(texts) / (embed_s + tokenize_s), 1),
        "tokenize_s": round(tokenize_s, 4),
        "embed_s": round(embed_s, 4),
    }

    def mfu(tflops: float | None) -> float | None:
        return None if not tflops else round(tokens_per_s * flops / (tflops * 1e12), 4)

    result = {
        "dtype": dtype,
        "engine": ours,
        "gflop_per_token": round(flops / 1e9, 5),
        "mfu": mfu((peak or {}).get("tflops")),
        "mfu_of_measured_matmul": mfu((peak or {}).get("measured_matmul_tflops")),
    }
    if with_sentence_transformers:
        result["sentence_transformers"], result["sentence_transformers_vectors"] = sentence_transformers_encode(
            model_dir, texts, device, dtype, best_of)
    return result


def packed_against_padded(packed: dict[str, EmbeddingService], padded: dict[str, EmbeddingService],
                          texts: list[str], best_of: int) -> dict:
    """The corpus in TorchServe-sized batches through packed and padded passes, in turns (the
    fastest of `best_of` each): real tokens/s, real / computed tokens, and each packed engine's
    ratio to each padded one."""
    engines = {**packed, **padded}
    first = next(iter(packed.values()))
    ids = first.text.token_ids(texts)
    batches = [ids[start:start + TORCHSERVE_BATCH] for start in range(0, len(ids), TORCHSERVE_BATCH)]
    best = dict.fromkeys(engines, float("inf"))
    computed = dict.fromkeys(engines, 0)
    for round_ in range(best_of):
        for name, engine in engines.items():
            began = time.perf_counter()
            runs = [engine.encoder.embed(plain_inputs(batch)) for batch in batches]  # each returns on the host
            best[name] = min(best[name], time.perf_counter() - began)
            computed[name] = sum(run.padded_tokens for run in runs)
    real = sum(map(len, ids))
    rows = {name: {"real_tokens_per_s": round(real / best[name], 1),
                   "real_over_computed_tokens": round(real / computed[name], 4)} for name in engines}
    for name in packed:
        rows[name].update({f"over_{other}": round(best[other] / best[name], 3) for other in padded})
    return {"texts": len(texts), "batch": TORCHSERVE_BATCH, "attention": first.info()["attention"],
            "layout": first.info()["layout"], **rows}


def sentence_transformers_encode(model_dir: Path, texts: list[str], device: str, dtype: str,
                                 best_of: int) -> tuple[dict, np.ndarray]:
    with library_threads():
        return _sentence_transformers_encode(model_dir, texts, device, dtype, best_of)


def _sentence_transformers_encode(model_dir: Path, texts: list[str], device: str, dtype: str,
                                  best_of: int) -> tuple[dict, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    # Loaded in the dtype asked for (transformers otherwise keeps the stored one), and cast to be sure.
    model = SentenceTransformer(str(model_dir), device=device, model_kwargs={"dtype": getattr(torch, dtype)})
    model.to(getattr(torch, dtype))
    rows, vectors = {}, None
    for batch_size in ST_BATCH_SIZES:
        model.encode(texts[:batch_size], batch_size=batch_size)  # warm up
        best = float("inf")
        for _ in range(best_of):
            began = time.perf_counter()
            out = model.encode(texts, batch_size=batch_size, normalize_embeddings=True)
            best = min(best, time.perf_counter() - began)
        vectors = np.asarray(out, dtype=np.float32) if vectors is None else vectors
        rows[str(batch_size)] = {"batch_size": batch_size, "texts_per_s": round(len(texts) / best, 1)}
    del model
    return {"dtype": dtype, "by_batch_size": rows}, vectors


def handle(engine: EmbeddingService, texts: list[str], batch: int = TORCHSERVE_BATCH) -> dict:
    """`handle` on back-to-back TorchServe batches of one-text JSON requests, as the TorchServe
    handler hands them over (decode_input_request=false: the raw body bytes)."""
    requests = [RawRequest(bytearray(json.dumps({"input": text}).encode()), "application/json", "")
                for text in texts]
    with_report = getattr(engine, "handle_with_report", None)
    engine.handle(requests[:batch])  # warm up
    stages: dict[str, float] = {}
    statuses: dict[int, int] = {}
    wall = 0.0
    for start in range(0, len(requests), batch):
        began = time.perf_counter()
        if with_report is not None:
            responses, report = with_report(requests[start : start + batch])
            for key, value in vars(report).items():
                if key.endswith("_ms") and isinstance(value, (int, float)):
                    stages[key] = stages.get(key, 0.0) + value
        else:
            responses = engine.handle(requests[start : start + batch])
        wall += time.perf_counter() - began
        for response in responses:
            statuses[response.status] = statuses.get(response.status, 0) + 1
    batches = -(-len(requests) // batch)
    result = {"batch": batch, "batches": batches, "texts_per_s": round(len(requests) / wall, 1),
              "wall_ms_per_batch": round(wall * 1e3 / batches, 4), "statuses": statuses,
              "ms_per_batch": {key.removesuffix("_ms"): round(value / batches, 4) for key, value in stages.items()}}
    model_ms = stages.get("model_ms")
    if model_ms:
        host = sum(stages.get(f"{stage}_ms", 0.0) for stage in HOST_STAGES) if "parse_ms" in stages \
            else wall * 1e3 - model_ms  # the report lacks the host stages: all time outside the model
        result["host_over_model"] = round(host / model_ms, 4)
    return result
