"""Every tested model family (tests/support/model_families.py) in every GPU mode, one family per process.

    python -m bench.gpu_families FAMILY --out DIR [--device auto|cuda|cpu] [--texts N] [--modes A,B]

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
from embedserve.handler.assembly import assemble
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings
from tests.support.model_families import FAMILIES, corpus, make_family
from embedserve.handler.model.inputs import plain_inputs

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gpu_families", description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--texts", type=int, default=96)
    parser.add_argument("--modes", help="comma-separated mode names (default: every mode of the device)")
    args = parser.parse_args(argv)
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
        result = run(args.family, Path(scratch), cuda, args.texts, modes, write)
    print(summary(result))
    return 0 if result["ok"] else 1


def run(family: str, scratch: Path, cuda: bool, count: int, modes: dict[str, dict],
        write=lambda result: None) -> dict:
    """The family's every mode; `write` gets the result so far after each (`complete`: false
    until the last)."""
    device = "cuda" if cuda else "cpu"
    model_dir = make_family(family, scratch / family)
    # Mixed lengths, a few over the model's max length (cut, as served).
    texts = [text * (1 + i % 5) for i, text in enumerate(corpus(count, seed=11))]
    reference_engine, _ = _engine(model_dir, device, dtype="float32", max_batch_size=1, unpadded=True)
    ids = reference_engine.text.token_ids(texts)
    reference = reference_engine.encoder.embed(plain_inputs(ids)).vectors.numpy()
    del reference_engine
    rows, vectors = {}, {}
    result = {"family": family, "device": device, "texts": len(texts), "tokens": sum(map(len, ids)),
              "modes": rows, "ok": False, "complete": False}
    for name, settings in modes.items():
        rows[name], vectors[name] = mode(model_dir, device, settings, ids, reference)
        twin = EAGER_TWIN.get(name)
        if vectors[name] is not None and vectors.get(twin) is not None:
            against = compare(vectors[name], vectors[twin])
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


def mode(model_dir: Path, device: str, settings: dict, ids: list[list[int]],
         reference: np.ndarray) -> tuple[dict, np.ndarray | None]:
    """One engine of `settings`: how it runs and how far its vectors lie from the reference."""
    started = time.perf_counter()
    try:
        engine, warnings = _engine(model_dir, device, **settings)
    except Exception as err:  # a start-up failure is a finding, not the end of the run
        return {"started": False, "error": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-4000:]}, None
    row = {"started": True, "startup_s": round(time.perf_counter() - started, 3)}
    info = engine.info()
    row.update(layout=info["layout"], attention=info["attention"], graphs_captured=info["cuda_graphs"])
    if warnings:
        row["startup_warnings"] = warnings
    runner = graphs_of(engine.encoder.backend)
    before = None if runner is None else (runner.replays, runner.eager)
    try:
        vectors = np.concatenate([engine.encoder.embed(plain_inputs(ids[i:i + TORCHSERVE_BATCH])).vectors.numpy()
                                  for i in range(0, len(ids), TORCHSERVE_BATCH)])
    except Exception as err:
        return {**row, "error": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-4000:]}, None
    if runner is not None:  # the corpus's own passes, not the warm-up's
        row.update(replays=runner.replays - before[0], eager_passes=runner.eager - before[1])
    measured = compare(vectors, reference)
    row["non_finite_rows"] = measured["nan_rows"]
    row["min_cosine"] = measured["min_cosine"] if measured["min_cosine"] is not None else 0.0
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
                     f"min cos {row['min_cosine']:.6f} non-finite {row['non_finite_rows']}{twin}")
    lines.append("ok" if result["ok"] else "NOT OK")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
