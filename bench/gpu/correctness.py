"""Each mode's vectors against the fp32 reference embedded one text at a time, and graphs against
the same passes run eagerly: on the corpus, and on the shapes where graph replay could go wrong."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from bench.gpu.engines import graphs_of
from embedserve.archive.corpus import load_tokenizer, text_of_length, vocabulary_words
from bench.gpu.common import TORCHSERVE_BATCH
from embedserve.handler.service import EmbeddingService
from embedserve.handler.model.inputs import plain_inputs


def mode_correctness(engine: EmbeddingService, name: str, texts: list[str], reference: np.ndarray,
                     vectors: dict[str, np.ndarray]) -> dict:
    """One mode's vectors for the corpus, embedded in TorchServe-sized batches, against the
    reference; graphs also against eager at the same dtype (its vectors from `vectors`, where this
    mode's are added: so run each eager twin before its graphs)."""
    before = _graph_counts(engine)
    vectors[name] = embed_batches(engine, texts)
    row = {"texts": len(texts), "batch": TORCHSERVE_BATCH, **compare(vectors[name], reference)}
    after = _graph_counts(engine)
    if after is not None:
        row["graph_replays"] = after[0] - before[0]
        row["eager_passes"] = after[1] - before[1]
        eager = _eager_twin(name, vectors)
        if eager is not None:
            row["vs_eager"] = compare(vectors[name], vectors[eager])
    return row


def embed_batches(engine: EmbeddingService, texts: list[str], batch: int = TORCHSERVE_BATCH) -> np.ndarray:
    ids = engine.text.token_ids(texts)
    return np.concatenate([engine.encoder.embed(plain_inputs(ids[i : i + batch])).vectors.numpy()
                           for i in range(0, len(ids), batch)])


def compare(vectors: np.ndarray, reference: np.ndarray) -> dict:
    """Cosine per row, and the largest difference between the unit vectors (either side may be
    normalized already); rows with NaN or inf are counted, not compared."""
    finite = np.isfinite(vectors).all(axis=1)
    if not finite.any():
        return {"min_cosine": None, "mean_cosine": None, "max_abs_diff": None, "max_rel_error": None,
                "nan_rows": len(vectors)}
    got, want = (x[finite].astype(np.float64) for x in (vectors, reference))
    a, b = _unit(got), _unit(want)
    cosine = (a * b).sum(axis=1)
    # As served, not normalized: a change of length is an error too (a cosine cannot see it).
    relative = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-30)
    return {"min_cosine": round(float(cosine.min()), 6), "mean_cosine": round(float(cosine.mean()), 6),
            "max_abs_diff": float(np.abs(a - b).max()), "max_rel_error": round(float(relative.max()), 6),
            "nan_rows": int((~finite).sum())}


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-30)


def adversarial(engines: dict[str, EmbeddingService], reference: EmbeddingService, model_dir: Path,
                results: dict, section) -> None:
    """Shapes where graph replay could go wrong, each against the one-text reference and, for
    graphs, against the same passes run eagerly: padding rows beside one real row, the extremes
    of length in one pass, a small bucket replayed after a large one, and distinct inputs that
    must stay distinct. Engines are run in order: each eager twin before its graphs. Each case
    goes into `results` as it is done; each engine's run of a case is a `section` of its own."""
    tokenizer = load_tokenizer(Path(model_dir) / "tokenizer.json")
    words, rng = vocabulary_words(tokenizer), random.Random(7)
    longest = min(256, reference.text.max_length)

    def text(tokens: int) -> str:
        return text_of_length(tokenizer, words, rng, min(tokens, longest))

    small, large, middle = text(12), text(longest), text(100)
    cases = {
        "one_row_in_large_bucket": [[middle]],
        "lengths_2_and_256_in_one_pass": [["", large]],  # "" is [CLS] [SEP]: 2 tokens
        "small_large_small_replays": [[small], [large], [small]],
        "distinct_inputs": [[text(n) for n in (5, 9, 14, 20, 27, 33, 41, 50, 64, 80, 97, 120, 150, 190, 230, 256)]],
    }
    for case, calls in cases.items():
        texts = [t for call in calls for t in call]
        expected = reference.encoder.embed(plain_inputs(reference.text.token_ids(texts))).vectors.numpy()
        rows, outputs = {}, {}
        results[case] = {"tokens": [len(ids) for ids in reference.text.token_ids(texts)], "modes": rows}
        for name, engine in engines.items():
            row = section(f"correctness.adversarial.{case}.{name}", _adversarial_row, engine, name, case, calls,
                          expected, outputs)
            if row is not None:
                rows[name] = row


def _adversarial_row(engine: EmbeddingService, name: str, case: str, calls: list[list[str]], expected: np.ndarray,
                     outputs: dict[str, np.ndarray]) -> dict:
    before = _graph_counts(engine)
    output, passes = _embed_calls(engine, calls, one_pass=case.startswith("lengths"))
    row = {**compare(output, expected), "passes": passes}
    after = _graph_counts(engine)
    if after is not None:
        row["graph_replays"] = after[0] - before[0]
        twin = _eager_twin(name, outputs)
        if twin is not None:
            row["vs_eager"] = compare(output, outputs[twin])
    if case == "small_large_small_replays":
        row["repeat_max_abs_diff"] = float(np.abs(output[0] - output[2]).max())
    if case == "distinct_inputs":
        row["max_pairwise_cosine"] = _max_pairwise_cosine(output)
    outputs[name] = output
    return row


def _embed_calls(engine: EmbeddingService, calls: list[list[str]], one_pass: bool) -> tuple[np.ndarray, int]:
    encoder = engine.encoder
    measured = encoder.pass_overhead_tokens
    if one_pass:  # a pass so dear that the planner never splits
        encoder.pass_overhead_tokens = 10**9
    try:
        embedded = [encoder.embed(plain_inputs(engine.text.token_ids(call))) for call in calls]
    finally:
        encoder.pass_overhead_tokens = measured
    return np.concatenate([e.vectors.numpy() for e in embedded]), sum(e.passes for e in embedded)


def _max_pairwise_cosine(vectors: np.ndarray) -> float:
    unit = _unit(vectors.astype(np.float64))
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -1)
    return round(float(similarity.max()), 6)


def _graph_counts(engine: EmbeddingService) -> tuple[int, int] | None:
    """Replays and eager passes so far of the engine's graphs, or None."""
    runner = graphs_of(engine.encoder.backend)
    return None if runner is None else (runner.replays, runner.eager)


def _eager_twin(name: str, names) -> str | None:
    """The engine a graphs engine is checked against, the same passes run eagerly: float16_graphs
    and float16_graphs_large_bucket -> float16_eager, float16_packed_graphs -> float16_packed."""
    stem = name.split("_graphs")[0]
    return next((twin for twin in (f"{stem}_eager", stem) if twin in names), None)
