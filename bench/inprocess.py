"""In-process measurements: our engine against sentence-transformers on the same model, corpus
and threads, and the CPU's matrix-multiply rate that bounds both."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from embedserve.handler.assembly import assemble
from embedserve.handler.model.pooling import l2_normalize
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings
from embedserve.handler.model.inputs import plain_inputs


def load_engine(model_dir: Path, threads: int, **settings) -> EmbeddingService:
    config = Settings.from_mapping({"device": "cpu", "cpu_threads": threads, **settings})
    return assemble(model_dir, config, model_name="bench", cuda_available=False, warm=True)


def bench_engine(engine: EmbeddingService, texts: Sequence[str], repeats: int = 2) -> tuple[dict, np.ndarray]:
    """Tokenize and embed the whole corpus as one batch (the engine sorts and cuts it); best of repeats."""
    best, embedded = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        embedded = engine.encoder.embed(plain_inputs(engine.text.token_ids(texts)))
        best = min(best, time.perf_counter() - started)
    vectors = l2_normalize(embedded.vectors).numpy()
    return {
        "texts_per_s": round(len(texts) / best, 1),
        "tokens_per_s": round(embedded.real_tokens / best, 1),
        "padding_efficiency": round(embedded.real_tokens / embedded.padded_tokens, 3),
        "forward_passes": embedded.passes,
    }, vectors


def bench_planner(engine: EmbeddingService, texts: Sequence[str], batch: int = 32) -> dict:
    """Texts/s and padding efficiency embedding `texts` in batches of `batch`, as TorchServe
    hands them to a worker: with the measured pass cost, and with passes filled to the token
    budget (a pass cost so high that fewer passes always win)."""
    ids = engine.text.token_ids(texts)
    encoder = engine.encoder
    measured = encoder.pass_overhead_tokens
    results = {}
    for name, overhead in (("least_cost", measured), ("fill_budget", encoder.placement.max_batch_tokens * 64)):
        encoder.pass_overhead_tokens = overhead
        started, real, padded, passes = time.perf_counter(), 0, 0, 0
        for start in range(0, len(ids), batch):
            embedded = encoder.embed(plain_inputs(ids[start : start + batch]))
            real, padded, passes = real + embedded.real_tokens, padded + embedded.padded_tokens, passes + embedded.passes
        results[name] = {"texts_per_s": round(len(ids) / (time.perf_counter() - started), 1),
                         "padding_efficiency": round(real / padded, 3), "forward_passes": passes}
    encoder.pass_overhead_tokens = measured
    return {"batch": batch, "pass_overhead_tokens": measured, **results}


def bench_sentence_transformers(model_dir: Path, texts: Sequence[str], threads: int, repeats: int = 2,
                                dtype: torch.dtype = torch.float32) -> tuple[dict, np.ndarray]:
    """sentence-transformers `encode` as its users call it: batches of 32, normalized. With
    `dtype=torch.bfloat16` the model is cast after loading, as a user with a CPU's bf16 matrix
    units would cast it: the baseline a served bf16 engine has to beat. Vectors come back fp32."""
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(model_dir), device="cpu")
    if dtype != torch.float32:
        model.to(dtype)
    model.encode(list(texts[:32]), batch_size=32)
    best, vectors = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        vectors = model.encode(list(texts), batch_size=32, normalize_embeddings=True)
        best = min(best, time.perf_counter() - started)
    return {"texts_per_s": round(len(texts) / best, 1)}, np.asarray(vectors, dtype=np.float32)


def cosine_stats(vectors: np.ndarray, reference: np.ndarray) -> dict:
    cosine = (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)
    return {"mean_cosine": round(float(cosine.mean()), 5), "min_cosine": round(float(cosine.min()), 5)}


def matmul_gflops(threads: int, size: int = 1024, seconds: float = 2.0) -> float:
    """fp32 torch.mm throughput: the ceiling for an encoder that is mostly matrix multiplies."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b)
        count += 1
    return 2 * size**3 * count / (time.perf_counter() - started) / 1e9


def flops_per_token(engine: EmbeddingService, sequence_length: int) -> float:
    """Forward FLOPs per token: 2 per weight of every encoder Linear, plus attention's two
    (seq x hidden) products per layer."""
    model = engine.encoder.backend.transformer.model  # the torch engine's
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and not name.startswith("pooler"))
    config = model.config
    attention = 4 * sequence_length * config.hidden_size * config.num_hidden_layers
    return 2 * linear + attention
