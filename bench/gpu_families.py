"""Every tested model family in every GPU mode, one family per process.

    python -m bench.gpu_families FAMILY --out DIR [--device auto|cuda|cpu] [--texts N] [--modes A,B] [--models DIR]
    python -m bench.gpu_families --prepare DIR      every family's folder, as the build stages it, into DIR/FAMILY

The families: those of tests/support/model_families.py (dense: BERT with Dense, XLM-R, MPNet,
Qwen3, ModernBERT), the native ports behind remote-code folders (nomic, GTE v1.5, Arctic-m-v2 in
their original layout; EmbeddingGemma; EuroBERT) and the other outputs (a SPLADE sparse
encoder, bge-m3's three outputs, a ColBERT multi-vector encoder), each a tiny random model made
offline by the tests' own makers and staged as `./build_mar.sh` stages it. Making the newer ones
needs the project's transformers and sentence-transformers: `--prepare` makes them where those
are installed, and `--models DIR` reads them there (scripts/gpu_travel.sh and gpu_run.sh do so).

Writes DIR/FAMILY.json: per mode (fp16 eager, fp16 CUDA graphs, fp16 packed with graphs and bf16
graphs on CUDA; fp32 eager, bf16 eager and fp32 packed in CPU mode) whether the engine started
(and the error if not), its layout, attention kernel, graphs captured, passes replayed and run
eagerly, the handler's warnings while it started (why a bucket or a layout fell back), and its
vectors against an fp32 reference that embeds each text alone: min cosine and rows with NaN or
inf. fp16 graphs are also compared with fp16 eager (largest error relative to the eager row).
scripts/gpu_run.sh runs each family in its own process under a time limit, so one family that
hangs or kills its process cannot take the others' figures with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.gpu.correctness import compare
from bench.gpu.engines import graphs_of, release
from bench.gpu.report import GRAPHS_MAX_REL_ERROR
from bench.gpu.speed import one_input_latency
from embedserve.archive.stage import stage_model
from embedserve.handler.assembly import assemble
from embedserve.handler.execution.encoder import HybridVectors, SparseRows
from embedserve.handler.model.inputs import plain_inputs
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings
from tests.support.model_families import FAMILIES as DENSE_FAMILIES, corpus, make_family

NATIVE_FAMILIES = ("nomic", "gte", "arctic", "embeddinggemma", "eurobert")
OUTPUT_FAMILIES = ("splade", "m3", "colbert")
FAMILIES = DENSE_FAMILIES + NATIVE_FAMILIES + OUTPUT_FAMILIES

CUDA_MODES = {  # name -> settings
    "float16_eager": dict(dtype="float16"),
    "float16_graphs": dict(dtype="float16", cuda_graphs=True),
    "float16_packed_graphs": dict(dtype="float16", packed=True, cuda_graphs=True),
    "bfloat16_graphs": dict(dtype="bfloat16", cuda_graphs=True),
}
CPU_MODES = {
    "float32_eager": dict(dtype="float32"),
    "bfloat16_eager": dict(dtype="bfloat16"),
    "float32_packed": dict(dtype="float32", packed=True),
}
# Graphs compared with the same passes run eagerly: padded graphs only (packed graphs pack their
# passes, so padded eager is not the same computation).
EAGER_TWIN = {"float16_graphs": "float16_eager"}
TORCHSERVE_BATCH = 32
MIN_COSINE = 0.999
ONE_TEXT_CALLS = 50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gpu_families", description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=FAMILIES, nargs="?")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--models", type=Path, help="prepared folders (DIR/FAMILY), made by --prepare")
    parser.add_argument("--prepare", type=Path, metavar="DIR", help="make every family's folder into DIR, and stop")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--texts", type=int, default=96)
    parser.add_argument("--modes", help="comma-separated mode names (default: every mode of the device)")
    args = parser.parse_args(argv)
    if args.prepare:
        for family in FAMILIES:
            print(family, make_model(family, args.prepare / family))
        return 0
    if not (args.family and args.out):
        parser.error("FAMILY and --out are needed (or --prepare DIR)")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    modes = CUDA_MODES if cuda else CPU_MODES
    if args.modes:
        unknown = set(args.modes.split(",")) - set(modes)
        if unknown:
            parser.error(f"unknown modes {', '.join(sorted(unknown))}; known: {', '.join(modes)}")
        modes = {name: settings for name, settings in modes.items() if name in args.modes.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{args.family}.json"

    def write(result: dict) -> None:  # after every mode: a later one may hang past the caller's limit
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(result, indent=2))
        partial.replace(target)

    with tempfile.TemporaryDirectory(prefix=f"family-{args.family}-") as scratch:
        model_dir = args.models / args.family if args.models and (args.models / args.family).is_dir() else None
        result = run(args.family, Path(scratch), cuda, args.texts, modes, write, model_dir=model_dir)
    print(summary(result))
    return 0 if result["ok"] else 1


def make_model(family: str, path: Path) -> Path:
    """The family's tiny random model, staged into `path` as the build stages a folder."""
    if family in DENSE_FAMILIES:
        return make_family(family, path)
    from tests.support import m3_models, multi_vector_models, native_models, sparse_models

    source = path.parent / f"{path.name}-source"
    makers = {"nomic": lambda: native_models.make_native_and_original("nomic", source)[1],  # the original layout
              "gte": lambda: native_models.make_native_and_original("gte", source)[1],
              "arctic": lambda: native_models.make_native_and_original("arctic", source)[1],
              "embeddinggemma": lambda: native_models.make_embeddinggemma(source),
              "eurobert": lambda: native_models.make_eurobert(source),
              "splade": lambda: sparse_models.make_splade(source),
              "m3": lambda: m3_models.make_m3(source),
              "colbert": lambda: multi_vector_models.make_colbert(source)}
    stage_model(makers[family](), path)
    for made in (source, source.with_name(f"{source.name}-raw")):  # the staged copy holds what serves
        shutil.rmtree(made, ignore_errors=True)
    return path


def run(family: str, scratch: Path, cuda: bool, count: int, modes: dict[str, dict],
        write=lambda result: None, model_dir: Path | None = None) -> dict:
    """The family's every mode; `write` gets the result so far after each (`complete`: false
    until the last). `model_dir`: the family's prepared folder (else it is made in `scratch`)."""
    device = "cuda" if cuda else "cpu"
    model_dir = model_dir or make_model(family, scratch / family)
    # Mixed lengths, a few over the model's max length (cut, as served).
    texts = [text * (1 + i % 5) for i, text in enumerate(corpus(count, seed=11))]
    reference_engine, _ = _engine(model_dir, device, dtype="float32", max_batch_size=1, unpadded=True)
    ids = reference_engine.text.token_ids(texts)
    reference = outputs(reference_engine, plain_inputs(ids))
    del reference_engine
    rows, vectors = {}, {}
    result = {"family": family, "device": device, "texts": len(texts), "tokens": sum(map(len, ids)),
              "modes": rows, "ok": False, "complete": False}
    for name, settings in modes.items():
        rows[name], vectors[name] = mode(model_dir, device, settings, ids, reference)
        twin = EAGER_TWIN.get(name)
        if vectors[name] is not None and vectors.get(twin) is not None:
            against = compare_outputs(vectors[name], vectors[twin])
            rows[name][f"vs_{twin}"] = {key: against[key] for key in ("min_cosine", "max_rel_error")}
        release(cuda)
        result["ok"] = all(_mode_ok(row) for row in rows.values()) and len(rows) == len(modes)
        write(result)
    result["complete"] = True
    write(result)
    return result


def _mode_ok(row: dict) -> bool:
    if "error" in row or row.get("non_finite_rows") != 0 or not row.get("min_cosine", 0) >= MIN_COSINE:
        return False
    twins = [value for key, value in row.items() if key.startswith("vs_")]
    return all(t["max_rel_error"] is not None and t["max_rel_error"] <= GRAPHS_MAX_REL_ERROR for t in twins)


def outputs(engine: EmbeddingService, inputs) -> dict[str, object]:
    """The engine's outputs of `inputs` by kind: "dense" (items, dimension), "sparse" [(2, entries):
    ids over weights], "tokens" [(tokens, dimension)]; bge-m3's three as dense, sparse and "colbert"."""
    vectors = engine.encoder.embed(inputs).vectors
    if isinstance(vectors, HybridVectors):
        return {"dense": vectors.dense.numpy(), "sparse": list(vectors.sparse), "colbert": list(vectors.colbert)}
    if isinstance(vectors, torch.Tensor):
        return {"dense": vectors.numpy()}
    return {"sparse" if engine.encoder.rows is SparseRows else "tokens": list(vectors)}


def concatenated(batches: list[dict[str, object]]) -> dict[str, object]:
    return {kind: np.concatenate([b[kind] for b in batches]) if kind == "dense" else
            [row for b in batches for row in b[kind]] for kind in batches[0]}


def compare_outputs(got: dict[str, object], want: dict[str, object]) -> dict:
    """Each output against the reference's: dense rows as they are; each sparse row as a vector
    over the ids either side has (an id one side lacks weighs 0 there); token vectors one by one
    (an item whose token count differs counts as a mismatch). The worst over the outputs, and
    each output's own figures."""
    per_output = {}
    for kind, rows in got.items():
        if kind == "dense":
            per_output[kind] = compare(rows, want[kind])
            continue
        if kind == "sparse":
            pairs = [_scattered(a, b) for a, b in zip(rows, want[kind])]
        else:
            pairs = [(a, b) for a, b in zip(rows, want[kind]) if a.shape == b.shape]
        items = [compare(a, b) for a, b in pairs if len(a)]
        per_output[kind] = {"min_cosine": min((i["min_cosine"] for i in items if i["min_cosine"] is not None),
                                              default=None),
                            "max_rel_error": max((i["max_rel_error"] for i in items
                                                  if i["max_rel_error"] is not None), default=None),
                            "nan_rows": sum(i["nan_rows"] for i in items),
                            "shape_mismatches": len(rows) - len(pairs)}
        if len(rows) != len(pairs):
            per_output[kind]["min_cosine"] = 0.0
    cosines = [row["min_cosine"] for row in per_output.values()]
    errors = [row["max_rel_error"] for row in per_output.values()]
    return {"min_cosine": None if None in cosines else min(cosines),
            "max_rel_error": None if None in errors else max(errors),
            "nan_rows": sum(row["nan_rows"] for row in per_output.values()), "outputs": per_output}


def _scattered(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two sparse rows ((2, entries)) as (1, ids of either) dense rows."""
    ids = np.union1d(got[0], want[0])
    a, b = np.zeros((1, len(ids)), np.float32), np.zeros((1, len(ids)), np.float32)
    a[0, np.searchsorted(ids, got[0])] = got[1]
    b[0, np.searchsorted(ids, want[0])] = want[1]
    return (a, b) if len(ids) else (np.zeros((0, 1), np.float32),) * 2


def mode(model_dir: Path, device: str, settings: dict, ids: list[list[int]],
         reference: dict[str, object]) -> tuple[dict, dict | None]:
    """One engine of `settings`: how it runs and how far its vectors lie from the reference."""
    started = time.perf_counter()
    try:
        engine, warnings = _engine(model_dir, device, **settings)
    except Exception as err:  # a start-up failure is a finding, not the end of the run
        return {"started": False, "error": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-4000:]}, None
    row = {"started": True, "startup_s": round(time.perf_counter() - started, 3)}
    info = engine.info()
    row.update(layout=info["layout"], attention=info["attention"], graphs_captured=info["cuda_graphs"],
               selected_by={k: v for k, v in engine.encoder.reasons.items() if k in ("layout", "cuda_graphs")})
    if warnings:
        row["startup_warnings"] = warnings
    runner = graphs_of(engine.encoder.backend)
    before = None if runner is None else (runner.replays, runner.eager)
    try:
        vectors = concatenated([outputs(engine, plain_inputs(ids[i:i + TORCHSERVE_BATCH]))
                                for i in range(0, len(ids), TORCHSERVE_BATCH)])
    except Exception as err:
        return {**row, "error": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-4000:]}, None
    if runner is not None:  # the corpus's own passes, not the warm-up's
        row.update(replays=runner.replays - before[0], eager_passes=runner.eager - before[1])
    measured = compare_outputs(vectors, reference)
    row["non_finite_rows"] = measured["nan_rows"]
    row["min_cosine"] = measured["min_cosine"] if measured["min_cosine"] is not None else 0.0
    if len(measured["outputs"]) > 1 or "dense" not in measured["outputs"]:
        row["outputs"] = {kind: {key: figures[key] for key in ("min_cosine", "max_rel_error", "nan_rows",
                                                                 "shape_mismatches") if key in figures}
                          for kind, figures in measured["outputs"].items()}
    # What graphs save a lone request: one short text's median wall time.
    row["one_text_ms"] = one_input_latency(engine, [ids[0][:16]], ONE_TEXT_CALLS, device == "cuda")["wall_ms"]
    return row, vectors


class _Collect(logging.Handler):
    """The handler's warnings and errors while an engine starts: why a bucket ran eagerly, why
    packed passes fell back to padded ones."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:500])


def _engine(model_dir: Path, device: str, *, unpadded: bool = False, **settings) -> tuple[EmbeddingService, list]:
    # Graphs and packed passes only where a mode asks (a GPU worker's default turns both on).
    config = Settings.from_mapping({"device": device, "engine": "torch", "cuda_graphs": False, "packed": False,
                                    **settings})
    unpad = (lambda placement: replace(placement, pad_multiple=1)) if unpadded else None  # the reference: no padding
    collect, logger = _Collect(), logging.getLogger("embedserve.handler")
    logger.addHandler(collect)
    try:
        engine = assemble(model_dir, config, model_name="family", cuda_available=torch.cuda.is_available(), warm=True,
                          adjust_placement=unpad)
    finally:
        logger.removeHandler(collect)
    return engine, collect.lines[:40]





def summary(result: dict) -> str:
    lines = [f"{result['family']} on {result['device']} ({result['texts']} texts, {result['tokens']} tokens)"]
    for name, row in result["modes"].items():
        if "error" in row:
            lines.append(f"  {name:24} FAILED {row['error'][:300]}")
            continue
        twin = next((f" vs eager: rel error {v['max_rel_error']}" for k, v in row.items() if k.startswith("vs_")), "")
        lines.append(f"  {name:24} {row['layout']:6} {row['attention']!s:14} graphs {row['graphs_captured']:3} "
                     f"replays {row.get('replays', '-')!s:>4} eager {row.get('eager_passes', '-')!s:>3} "
                     f"min cos {row['min_cosine']:.6f} non-finite {row['non_finite_rows']} "
                     f"one text {row.get('one_text_ms')} ms{twin}")
    lines.append("ok" if result["ok"] else "NOT OK")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
