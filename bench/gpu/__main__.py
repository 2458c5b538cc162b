"""The GPU benchmark: correctness, latency, saturation and the handler's cost, in one run.

    python -m bench.gpu --out DIR [--device auto|cuda|cpu] [--model PATH] [--set key=value ...]
    python -m bench.gpu --write-fp16-copy DIR [--model PATH]
    python -m bench.gpu --replot DIR

Writes DIR/gpu.json and DIR/gpu.png (docs/gpu.md says how to run it on a GPU machine):
1. the environment: versions, the GPU, the SDPA backends enabled and which of them run a padded
   attention;
2. correctness against an fp32 reference embedded one text at a time (no padding), on the mixed
   corpus in TorchServe-sized batches: fp16 eager, fp16 with CUDA graphs, bf16 eager and fp16
   packed passes (embedserve/handler/backends/packed.py), eager and with CUDA graphs over total tokens; then
   adversarial cases for graph replay (one row in a large bucket, lengths 2 and 256 in one pass,
   small-large-small replays, distinct inputs);
3. batch-1 latency at 16, 64 and 128 tokens, eager and graphs (CUDA events and wall clock);
4. saturation: real tokens/s and MFU of the engine against sentence-transformers fp16 `encode`,
   for the served model (all-MiniLM-L6-v2) and a BERT-base-sized model with random weights;
   packed passes (eager, and with graphs) against padded ones (eager, and with graphs) in
   TorchServe-sized batches: real tokens/s and real / computed tokens;
5. the engine's whole `handle` on TorchServe batches of one-text JSON requests: texts/s and the
   time split prepare / model / encode;
6. peak memory, graph capture and start-up times; then the targets.
gpu.json is rewritten after each section (`complete`: false until the end), so a run stopped by a
time limit still leaves what it measured; a section that fails is recorded under `errors` and
the next one runs.
With --device cpu (CI) the same steps run on a tiny random model in fp32 and bf16, without graphs.
--write-fp16-copy writes the model folder with float16 weights (half the bytes) and exits: the
copy to carry to a machine that cannot download the model. --replot draws DIR/gpu.png from
DIR/gpu.json (for a report from a machine without matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from embedserve.archive.corpus import mixed_corpus
from bench.gpu.common import TORCHSERVE_BATCH, mode_name, progress
from bench.gpu.correctness import adversarial, compare, embed_batches, mode_correctness
from bench.gpu.engines import Bench, PeakMemory, mib, release
from bench.gpu.environment import environment, peak_flops, sdpa_runs, tokenizer_threads
from bench.gpu.tensorrt import tensorrt_offer
from bench.gpu.models import default_model, describe, pick_models, write_fp16_copy
from bench.gpu.report import check_targets, checkpointer, plot, write_atomically
from bench.gpu.speed import handle, latency, packed_against_padded, saturation

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Plan:
    """How much each step measures: less on CPU, where CI runs every step on a tiny model."""

    texts: int  # correctness corpus
    repeats: int  # latency calls per shape
    saturation_texts: int
    best_of: int  # saturation runs; the fastest is kept


GPU_PLAN = Plan(texts=512, repeats=200, saturation_texts=4096, best_of=3)
CPU_PLAN = Plan(texts=64, repeats=10, saturation_texts=128, best_of=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", type=Path, help="model folder (default: all-MiniLM-L6-v2 on CUDA, "
                                                   "a tiny random BERT on CPU)")
    parser.add_argument("--texts", type=int, help="correctness corpus size (512 on CUDA)")
    parser.add_argument("--repeats", type=int, help="latency calls per shape (200 on CUDA)")
    parser.add_argument("--saturation-texts", type=int, help="saturation corpus size (4096 on CUDA)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a handler setting for every engine (JSON values: --set max_batch_tokens=32768)")
    parser.add_argument("--write-fp16-copy", type=Path, metavar="DIR",
                        help="write the model folder with float16 weights to DIR and exit")
    parser.add_argument("--replot", type=Path, metavar="DIR", help="draw DIR/gpu.png from DIR/gpu.json and exit")
    args = parser.parse_args(argv)

    if args.replot:
        plot(json.loads((args.replot / "gpu.json").read_text()), args.replot / "gpu.png")
        print(f"wrote {args.replot / 'gpu.png'}", file=sys.stderr)
        return 0

    if args.write_fp16_copy:
        source = args.model or default_model()
        target = write_fp16_copy(source, args.write_fp16_copy)
        size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        print(f"wrote {target} ({size / 2**20:.1f} MiB)", file=sys.stderr)
        return 0

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    default = GPU_PLAN if cuda else CPU_PLAN
    plan = Plan(args.texts or default.texts, args.repeats or default.repeats,
                args.saturation_texts or default.saturation_texts, default.best_of)
    overrides = dict(_setting(item) for item in args.set)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / "gpu.json"
    report.unlink(missing_ok=True)  # no figures of an earlier run under this run's name
    checkpoint = checkpointer(report, started)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-gpu-") as scratch, \
                PeakMemory(torch.cuda if cuda else None) as memory:
            results = run(Path(scratch), args.model, cuda, plan, overrides, memory, checkpoint)
    except Exception:  # outside every section: what the last checkpoint holds still counts
        traceback.print_exc()
        results = json.loads(report.read_text()) if report.is_file() else {"device": "cuda" if cuda else "cpu"}
        results.setdefault("errors", {})["run"] = traceback.format_exc()[-4000:]
    results["duration_s"] = round(time.perf_counter() - started, 1)
    results["targets"] = check_targets(results)
    results["complete"] = True
    write_atomically(report, json.dumps(results, indent=2))
    wrote = [report]
    try:
        plot(results, args.out / "gpu.png")
        wrote.append(args.out / "gpu.png")
    except ImportError as err:  # matplotlib is in the bench extras only: python -m bench.gpu --replot later
        print(f"no plot ({err})", file=sys.stderr)
    print(json.dumps(results["targets"], indent=2))
    if "errors" in results:
        print(f"sections that failed: {', '.join(results['errors'])}", file=sys.stderr)
    print(f"wrote {' and '.join(map(str, wrote))} in {results['duration_s']} s", file=sys.stderr)
    # The status says whether every figure came back, not whether it met its goal (gpu.json says).
    unmeasured = [row["target"] for row in results["targets"] if row["applicable"] and row["measured"] is None]
    for name in unmeasured:
        print(f"no value: {name}", file=sys.stderr)
    return 1 if unmeasured else 0


def run(scratch: Path, model: Path | None, cuda: bool, plan: Plan, overrides: dict, memory: PeakMemory,
        checkpoint=lambda results: None) -> dict:
    """Every section in order, the headline first: the served mode's speed against
    sentence-transformers, then correctness, latency, packed passes, the handler's cost, and the
    BERT-base-sized model. Every engine start, capture and check is a section of its own: one
    that fails records its error, and whatever does not depend on it still runs. `checkpoint`
    gets the results after each section."""
    device = "cuda" if cuda else "cpu"
    primary_dtype = "float16" if cuda else "float32"
    # The modes checked for correctness: (dtype, CUDA graphs).
    modes = [("float16", False), ("float16", True), ("bfloat16", False)] if cuda else \
        [("float32", False), ("bfloat16", False)]
    # Packed passes (embedserve/handler/backends/packed.py), eager; on CUDA also replayed from graphs over total tokens.
    packed_names = [f"{primary_dtype}_packed"] + ([f"{primary_dtype}_packed_graphs"] if cuda else [])
    models = pick_models(scratch, model, cuda)
    results: dict = {
        "device": device,
        "environment": environment(cuda),
        "plan": {**vars(plan), "torchserve_batch": TORCHSERVE_BATCH, "settings": overrides},
        "models": {role: describe(*model) for role, model in models.items()},
        "engines": {},
        "memory_mib": {},
        "correctness": {"modes": {}, "adversarial": {}},
        "saturation": {},
        "handle": {},
    }
    section = Sections(results, checkpoint)
    if cuda:
        results["environment"]["sdpa_runs"] = section("environment.sdpa_runs", sdpa_runs)
    # What a TensorRT engine could run on here: its wheels are far over what a GPU call carries.
    results["environment"]["tensorrt"] = section("environment.tensorrt", tensorrt_offer)
    results["peak_flops"] = section("peak_flops", peak_flops, cuda)
    bench = Bench(device, overrides, results["engines"], memory)
    primary, name_of_primary = models["minilm"][:2]
    corpus = mixed_corpus(primary / "tokenizer.json", max(plan.texts, plan.saturation_texts))
    texts, saturation_texts = corpus[: plan.texts], corpus[: plan.saturation_texts]
    engines: dict = {}

    def absent(*names: str) -> list[str]:  # the engines a section needs that did not start
        return [name for name in names if name not in engines]

    def start(name: str, folder: Path = primary, **settings) -> None:
        progress(f"{folder.name}: {name} ...")
        engine = section(f"engine.{name}", bench.engine, name, folder, **settings)
        if engine is not None:
            engines[name] = engine

    eager, graphs = mode_name(primary_dtype, False), mode_name("float16", True)
    minilm_memory = memory.open()
    start(eager, dtype=primary_dtype)
    results["environment"]["tokenizer_threads"] = tokenizer_threads()
    progress("saturation ...")
    minilm = section("saturation.minilm", lambda: saturation(
        engines[eager], primary, saturation_texts, device, primary_dtype, plan.best_of, results["peak_flops"]),
        missing=absent(eager))
    if minilm is not None:
        st_vectors = minilm.pop("sentence_transformers_vectors")
        results["saturation"]["minilm"] = minilm

    progress(f"{name_of_primary}: fp32 reference, one text at a time ...")
    start("reference_float32", dtype="float32", max_batch_size=1, unpadded=True, warmup=False)
    reference = section("reference", lambda: embed_batches(engines["reference_float32"], texts, batch=len(texts)),
                        missing=absent("reference_float32"))
    if reference is not None and minilm is not None:  # sentence-transformers' own vectors: the same texts first
        shared = min(len(st_vectors), len(reference))
        minilm["sentence_transformers_vs_reference"] = compare(st_vectors[:shared], reference[:shared])
    for dtype, use_graphs in modes:
        if mode_name(dtype, use_graphs) != eager:
            start(mode_name(dtype, use_graphs), dtype=dtype, cuda_graphs=use_graphs)
    if cuda:  # every pass of this one runs in its single large bucket: few rows among many padding rows
        start("float16_graphs_large_bucket", dtype="float16", cuda_graphs=True, cuda_graph_batches=[64],
              cuda_graph_lengths=[256])
    for name in packed_names:
        start(name, dtype=primary_dtype, packed=True, cuda_graphs=name.endswith("_graphs"))
        if name in engines:
            info = engines[name].info()
            results["engines"][name].update(layout=info["layout"], attention=info["attention"])
    # Capture happens while an engine loads: its start-up less its eager twin's.
    for captured, twin in ((graphs, eager), *([packed_names[::-1]] if cuda else [])):
        if captured in results["engines"] and twin in results["engines"]:
            row = results["engines"][captured]
            row["graph_capture_s"] = round(row["startup_s"] - results["engines"][twin]["startup_s"], 3)

    vectors: dict = {}
    for name in [mode_name(*m) for m in modes] + packed_names:  # each eager twin before its graphs
        row = section(f"correctness.{name}", lambda: mode_correctness(engines[name], name, texts, reference, vectors),
                      missing=absent(name) + ([] if reference is not None else ["reference"]))
        if row is not None:
            results["correctness"]["modes"][name] = row
    adversarial_engines = {name: engines[name] for name in (eager, graphs, "float16_graphs_large_bucket",
                                                            *packed_names) if name in engines}
    section("correctness.adversarial", lambda: adversarial(
        adversarial_engines, engines["reference_float32"], primary, results["correctness"]["adversarial"], section),
        missing=absent("reference_float32"))

    progress("batch-1 latency ...")
    latency_engines = {label: engines[name] for label, name in (("eager", eager), ("graphs", graphs))
                       if name in engines and (cuda or label == "eager")}
    results["latency"] = section("latency", latency, latency_engines, primary, plan.repeats, cuda,
                                 missing=absent(eager))
    progress("packed against padded passes ...")
    padded = {name: engines[name] for name in (eager, graphs) if name in engines}
    packed = {name.replace(f"{primary_dtype}_", "", 1): engines[name] for name in packed_names if name in engines}
    results["packed"] = section("packed", packed_against_padded, packed, padded, saturation_texts, plan.best_of,
                                missing=absent(eager, packed_names[0]))
    progress("the engine's handle on TorchServe batches ...")
    for name in (eager, graphs, *packed_names[1:]):  # on CUDA, packed graphs: a GPU worker's default
        row = section(f"handle.{name}", handle, engines[name], saturation_texts) if name in engines else None
        if row is not None:
            results["handle"][name] = row
    results["memory_mib"]["minilm"] = mib(memory.close(minilm_memory))
    for held in (engines, adversarial_engines, latency_engines, padded, packed):
        held.clear()
    release(cuda)

    second = models["bert_base"][0]
    progress(f"{models['bert_base'][1]}: saturation ...")
    bert_memory = memory.open()
    # Padded eager against sentence-transformers; on CUDA also a GPU worker's default engine,
    # packed passes replayed from graphs (sentence-transformers' side is the same: not run again).
    runs = {"bert_base": (f"bert_base_{primary_dtype}_eager", {"dtype": primary_dtype})}
    if cuda:
        runs["bert_base_packed_graphs"] = ("bert_base_float16_packed_graphs",
                                           {"dtype": "float16", "packed": True, "cuda_graphs": True})
    for role, (name, settings) in runs.items():
        start(name, second, **settings)
        row = section(f"saturation.{role}", lambda: saturation(
            engines[name], second, saturation_texts, device, settings["dtype"], plan.best_of, results["peak_flops"],
            with_sentence_transformers=role == "bert_base"), missing=absent(name))
        engines.pop(name, None)
        release(cuda)
        if row is not None:
            row.pop("sentence_transformers_vectors", None)
            results["saturation"][role] = row
    results["memory_mib"]["bert_base"] = mib(memory.close(bert_memory))
    return results


class Sections:
    """`section(name, work, *args, missing=[...], **kwargs)` returns work(*args, **kwargs), or None
    with the error recorded under results["errors"][name]: never raised (a GPU machine is lent
    rarely: the other sections' figures must still come back). `missing` names what the work
    needs that an earlier section failed to make: the work is then skipped, with that reason.
    The results are checkpointed after each section. BENCH_GPU_FAIL=name[,name...] makes those
    sections fail on purpose without running (the dry run of a failure)."""

    def __init__(self, results: dict, checkpoint):
        self.results = results
        self.checkpoint = checkpoint
        self.forced = {name.strip() for name in os.environ.get("BENCH_GPU_FAIL", "").split(",") if name.strip()}

    def __call__(self, name: str, work: Callable, *args, missing: list[str] = (), **kwargs):
        try:
            if missing:
                return self._record(name, f"skipped: needs {', '.join(missing)}, which failed")
            if name in self.forced:
                return self._record(name, "forced failure (BENCH_GPU_FAIL)")
            return work(*args, **kwargs)
        except Exception as err:
            progress(f"{name} failed: {type(err).__name__}: {err}")
            return self._record(name, traceback.format_exc()[-4000:])
        finally:
            self.checkpoint(self.results)

    def _record(self, name: str, error: str) -> None:
        if len(error) < 200:
            progress(f"{name}: {error}")
        self.results.setdefault("errors", {})[name] = error


def _setting(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--set {item}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


if __name__ == "__main__":
    sys.exit(main())
