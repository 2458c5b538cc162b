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
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from embedserve.archive.corpus import mixed_corpus
from bench.gpu.common import TORCHSERVE_BATCH, mode_name, progress
from bench.gpu.correctness import adversarial, correctness
from bench.gpu.engines import Bench, PeakMemory, mib, release
from bench.gpu.environment import environment, peak_flops
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
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as scratch, PeakMemory(torch.cuda if cuda else None) as memory:
        results = run(Path(scratch), args.model, cuda, plan, overrides, memory, checkpoint)
    results["duration_s"] = round(time.perf_counter() - started, 1)
    try:
        results["targets"] = check_targets(results)
    except Exception:  # a section is missing (see errors): the figures still count
        results["targets"] = []
        results.setdefault("errors", {})["targets"] = traceback.format_exc()[-4000:]
    results["complete"] = True
    write_atomically(report, json.dumps(results, indent=2))
    wrote = [report]
    try:
        plot(results, args.out / "gpu.png")
        wrote.append(args.out / "gpu.png")
    except ImportError as err:  # matplotlib is in the bench extras only: python -m bench.gpu --replot later
        print(f"no plot ({err})", file=sys.stderr)
    except Exception as err:  # a missing section; gpu.json holds what there is
        print(f"no plot ({type(err).__name__}: {err})", file=sys.stderr)
    print(json.dumps(results["targets"], indent=2))
    if "errors" in results:
        print(f"sections that failed: {', '.join(results['errors'])}", file=sys.stderr)
    print(f"wrote {' and '.join(map(str, wrote))} in {results['duration_s']} s", file=sys.stderr)
    return 0


def run(scratch: Path, model: Path | None, cuda: bool, plan: Plan, overrides: dict, memory: PeakMemory,
        checkpoint=lambda results: None) -> dict:
    """Every section in order, the minilm model's then the BERT-base-sized one's; `checkpoint` gets
    the results after each section."""
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
    }
    bench = Bench(device, overrides, results["engines"], memory)
    checkpoint(results)
    primary = models["minilm"][0]
    corpus = mixed_corpus(primary / "tokenizer.json", max(plan.texts, plan.saturation_texts))
    texts = corpus[: plan.texts]

    progress(f"{models['minilm'][1]}: fp32 reference, one text at a time ...")
    minilm_memory = memory.open()
    reference_engine = bench.engine("reference_float32", primary, dtype="float32", max_batch_size=1, unpadded=True,
                                    warmup=False)
    reference = reference_engine.encoder.embed(reference_engine.preparer.token_ids(texts)).vectors.numpy()
    engines = {}
    for dtype, graphs in modes:
        name = mode_name(dtype, graphs)
        progress(f"{models['minilm'][1]}: {name} ...")
        engines[name] = bench.engine(name, primary, dtype=dtype, cuda_graphs=graphs)
    if cuda:
        eager_startup = results["engines"][mode_name("float16", False)]["startup_s"]
        graphs_row = results["engines"][mode_name("float16", True)]
        # Capture happens while the engine loads: its start-up less the eager engine's.
        graphs_row["graph_capture_s"] = round(graphs_row["startup_s"] - eager_startup, 3)
        # Every pass of this one runs in its single large bucket: few rows among many padding rows.
        engines["float16_graphs_large_bucket"] = bench.engine(
            "float16_graphs_large_bucket", primary, dtype="float16", cuda_graphs=True,
            cuda_graph_batches=[64], cuda_graph_lengths=[256])

    for name in packed_names:
        progress(f"{models['minilm'][1]}: {name} ...")
        engines[name] = bench.engine(name, primary, dtype=primary_dtype, packed=True,
                                     cuda_graphs=name.endswith("_graphs"))
        info = engines[name].info()
        results["engines"][name].update(layout=info["layout"], attention=info["attention"])
    if cuda:  # as for padded graphs: the capture is the start-up less the eager engine's
        packed_eager, packed_graphs = (results["engines"][name] for name in packed_names)
        packed_graphs["graph_capture_s"] = round(packed_graphs["startup_s"] - packed_eager["startup_s"], 3)
    results["correctness"] = correctness(engines, [mode_name(*m) for m in modes] + packed_names, texts, reference)
    checkpoint(results)
    eager, graphs = mode_name(primary_dtype, False), mode_name("float16", True)
    adversarial_engines = {name: engines[name] for name in (eager, graphs, "float16_graphs_large_bucket",
                                                            *packed_names) if name in engines}
    # From here on each section stands alone: one that fails leaves its error and the next runs.
    with _section(results, "adversarial", checkpoint):
        results["correctness"]["adversarial"] = adversarial(adversarial_engines, reference_engine, primary)

    progress("batch-1 latency ...")
    latency_engines = {"eager": engines[eager], **({"graphs": engines[graphs]} if cuda else {})}
    with _section(results, "latency", checkpoint):
        results["latency"] = latency(latency_engines, primary, plan.repeats, cuda)

    progress("saturation ...")
    saturation_texts = corpus[: plan.saturation_texts]
    with _section(results, "peak_flops", checkpoint):
        results["peak_flops"] = peak_flops(cuda)
    with _section(results, "saturation_minilm", checkpoint):
        results.setdefault("saturation", {})["minilm"] = saturation(
            engines[eager], primary, saturation_texts, device, primary_dtype, plan.best_of, results["peak_flops"],
            reference)
    progress("packed against padded passes ...")
    padded = {name: engines[name] for name in (eager, graphs) if name in engines}
    with _section(results, "packed", checkpoint):
        results["packed"] = packed_against_padded({name.replace(f"{primary_dtype}_", "", 1): engines[name]
                                                   for name in packed_names}, padded, saturation_texts, plan.best_of)
    progress("the engine's handle on TorchServe batches ...")
    with _section(results, "handle", checkpoint):
        results["handle"] = {name: handle(engines[name], saturation_texts) for name in [eager, graphs]
                             if name in engines}
    results["memory_mib"]["minilm"] = mib(memory.close(minilm_memory))
    del reference_engine, engines, adversarial_engines, latency_engines
    release(cuda)

    second = models["bert_base"][0]
    progress(f"{models['bert_base'][1]}: saturation ...")
    bert_memory = memory.open()
    with _section(results, "saturation_bert_base", checkpoint):
        engine = bench.engine(f"bert_base_{primary_dtype}_eager", second, dtype=primary_dtype)
        results.setdefault("saturation", {})["bert_base"] = saturation(
            engine, second, saturation_texts, device, primary_dtype, plan.best_of, results["peak_flops"])
        del engine
    results["memory_mib"]["bert_base"] = mib(memory.close(bert_memory))
    release(cuda)
    return results


@contextmanager
def _section(results: dict, name: str, checkpoint) -> object:
    """Run the block; an exception in it is recorded under results["errors"][name], not raised
    (a GPU machine is lent rarely: the other sections' figures must still come back)."""
    try:
        yield
    except Exception as err:
        progress(f"{name} failed: {type(err).__name__}: {err}")
        results.setdefault("errors", {})[name] = traceback.format_exc()[-4000:]
    checkpoint(results)


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
