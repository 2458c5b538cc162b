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
import gc
import json
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from embedserve.archive.corpus import load_tokenizer, mixed_corpus, text_of_length, vocabulary_words
from bench.inprocess import flops_per_token, matmul_gflops
from embedserve.handler.assembly import assemble
from embedserve.handler.execution.placement import available_cpus
from embedserve.handler.service import EmbeddingService, RawRequest
from embedserve.handler.settings import Settings

REPO = Path(__file__).resolve().parent.parent
LATENCY_TOKENS = (16, 64, 128)
TORCHSERVE_BATCH = 32  # the build's batchSize: requests per TorchServe batch
ST_BATCH_SIZES = (32, 256)  # sentence-transformers' default, and a large one
# Model shapes (BertConfig fields). Random weights serve the speed figures only.
MINILM_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
BERT_BASE_SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
CPU_STANDIN_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
# Dense fp16/bf16 tensor-core peaks from NVIDIA's datasheets (the sparse figures halved), matched
# on the device name in this order; other GPUs are measured with a large matmul.
PEAK_TFLOPS = (
    ("h200 nvl", 835.5, "H200 NVL"),
    ("h200", 989.4, "H200 SXM"),
    ("h100 nvl", 835.5, "H100 NVL"),
    ("h100 pcie", 756.5, "H100 PCIe"),
    ("h100", 989.4, "H100 SXM"),
)
# Graphs against the same passes run eagerly: the cosine, blind to a change of length, and the
# largest distance between two rows relative to the eager row's length (embedserve/handler/backends/cuda_graphs.py's
# measure), which a 3% replay error fails whatever its direction.
GRAPHS_MIN_COSINE = 0.9999
GRAPHS_MAX_REL_ERROR = 0.01
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@dataclass(frozen=True)
class Plan:
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
        source = args.model or _default_model()
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

    def checkpoint(results: dict) -> None:
        results["duration_s"] = round(time.perf_counter() - started, 1)
        _write_atomically(report, json.dumps({**results, "complete": False}, indent=2))

    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as scratch, PeakMemory(torch.cuda if cuda else None) as memory:
        results = run(Path(scratch), args.model, cuda, plan, overrides, memory, checkpoint)
    results["duration_s"] = round(time.perf_counter() - started, 1)
    try:
        results["targets"] = check_targets(results)
    except Exception:  # a section is missing (see errors): the figures still count
        results["targets"] = []
        results.setdefault("errors", {})["targets"] = traceback.format_exc()[-4000:]
    results["complete"] = True
    _write_atomically(report, json.dumps(results, indent=2))
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


def run(scratch: Path, model: Path | None, cuda: bool, plan: Plan, overrides: dict, memory: "PeakMemory",
        checkpoint=lambda results: None) -> dict:
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

    _progress(f"{models['minilm'][1]}: fp32 reference, one text at a time ...")
    minilm_memory = memory.open()
    reference_engine = bench.engine("reference_float32", primary, dtype="float32", max_batch_size=1, unpadded=True,
                                    warmup=False)
    reference = reference_engine.encoder.embed(reference_engine.preparer.token_ids(texts)).vectors.numpy()
    engines = {}
    for dtype, graphs in modes:
        name = mode_name(dtype, graphs)
        _progress(f"{models['minilm'][1]}: {name} ...")
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
        _progress(f"{models['minilm'][1]}: {name} ...")
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

    _progress("batch-1 latency ...")
    latency_engines = {"eager": engines[eager], **({"graphs": engines[graphs]} if cuda else {})}
    with _section(results, "latency", checkpoint):
        results["latency"] = latency(latency_engines, primary, plan.repeats, cuda)

    _progress("saturation ...")
    saturation_texts = corpus[: plan.saturation_texts]
    with _section(results, "peak_flops", checkpoint):
        results["peak_flops"] = peak_flops(cuda)
    with _section(results, "saturation_minilm", checkpoint):
        results.setdefault("saturation", {})["minilm"] = saturation(
            engines[eager], primary, saturation_texts, device, primary_dtype, plan.best_of, results["peak_flops"],
            reference)
    _progress("packed against padded passes ...")
    padded = {name: engines[name] for name in (eager, graphs) if name in engines}
    with _section(results, "packed", checkpoint):
        results["packed"] = packed_against_padded({name.replace(f"{primary_dtype}_", "", 1): engines[name]
                                                   for name in packed_names}, padded, saturation_texts, plan.best_of)
    _progress("the engine's handle on TorchServe batches ...")
    with _section(results, "handle", checkpoint):
        results["handle"] = {name: handle(engines[name], saturation_texts) for name in [eager, graphs]
                             if name in engines}
    results["memory_mib"]["minilm"] = _mib(memory.close(minilm_memory))
    del reference_engine, engines, adversarial_engines, latency_engines
    _release(cuda)

    second = models["bert_base"][0]
    _progress(f"{models['bert_base'][1]}: saturation ...")
    bert_memory = memory.open()
    with _section(results, "saturation_bert_base", checkpoint):
        engine = bench.engine(f"bert_base_{primary_dtype}_eager", second, dtype=primary_dtype)
        results.setdefault("saturation", {})["bert_base"] = saturation(
            engine, second, saturation_texts, device, primary_dtype, plan.best_of, results["peak_flops"])
        del engine
    results["memory_mib"]["bert_base"] = _mib(memory.close(bert_memory))
    _release(cuda)
    return results


@contextmanager
def _section(results: dict, name: str, checkpoint) -> object:
    """Run the block; an exception in it is recorded under results["errors"][name], not raised
    (a GPU machine is lent rarely: the other sections' figures must still come back)."""
    try:
        yield
    except Exception as err:
        _progress(f"{name} failed: {type(err).__name__}: {err}")
        results.setdefault("errors", {})[name] = traceback.format_exc()[-4000:]
    checkpoint(results)


def mode_name(dtype: str, graphs: bool) -> str:
    return f"{dtype}_{'graphs' if graphs else 'eager'}"


class Bench:
    """Starts engines through the public entry points, as a TorchServe worker does, and records
    each one's start-up time, the device memory it holds and the most it held at once starting."""

    def __init__(self, device: str, overrides: dict, records: dict, memory: "PeakMemory"):
        self.device = device
        self.overrides = overrides
        self.records = records
        self.memory = memory

    def engine(self, name: str, model_dir: Path, *, unpadded: bool = False, warmup: bool = True,
               **settings) -> EmbeddingService:
        threads = {} if self.device == "cuda" else {"cpu_threads": available_cpus()}
        config = Settings.from_mapping({"device": self.device, "engine": "torch", **threads, **self.overrides,
                                        **settings})
        # The reference: no pad-to-multiple, so a one-text pass holds no padding at all.
        unpad = (lambda placement: replace(placement, pad_multiple=1)) if unpadded else None
        _sync(self.device)
        before = torch.cuda.memory_allocated() if self.device == "cuda" else 0
        window = self.memory.open()
        started = time.perf_counter()
        engine = assemble(model_dir, config, model_name="bench", cuda_available=torch.cuda.is_available(),
                          warm=warmup, adjust_placement=unpad)
        _sync(self.device)
        record = {"startup_s": round(time.perf_counter() - started, 3),
                  "pass_overhead_tokens": getattr(engine.encoder, "pass_overhead_tokens", None)}
        startup_peak = self.memory.close(window)
        if self.device == "cuda":
            record["resident_mib"] = round((torch.cuda.memory_allocated() - before) / 2**20, 1)
            record["startup_peak_mib"] = _mib(startup_peak)
        runner = engine.encoder.graph_runner
        if runner is not None:
            record["graphs_captured"] = len(runner.graphs)
        self.records[name] = record
        return engine


# -- models ---------------------------------------------------------------------------------------

def pick_models(scratch: Path, model: Path | None, cuda: bool) -> dict[str, tuple[Path, str, str]]:
    """The served model and the BERT-base-sized one: (folder, name, what its weights are)."""
    if model is not None:
        primary = (model, model.name, "as given (--model)")
    elif cuda:
        try:
            primary = (_default_model(), "all-MiniLM-L6-v2", "pretrained")
        except Exception as err:  # no network and no cache: the shape alone still gives speed figures
            _progress(f"all-MiniLM-L6-v2 unavailable ({err}); a random model of its shape stands in")
            primary = (random_model(scratch / "minilm-random", MINILM_SHAPE, _tiny(scratch / "tiny")),
                       "all-MiniLM-L6-v2-shaped", "RANDOM (a tiny vocabulary; speed and dtype paths only)")
    else:
        primary = (_tiny(scratch / "tiny"), "tiny BERT", "random (CPU mode)")
    shape, name, weights = (BERT_BASE_SHAPE, "BERT-base-sized", "RANDOM, from a config") if cuda else \
        (CPU_STANDIN_SHAPE, "small stand-in for BERT-base", "RANDOM, from a config (CPU mode)")
    second = random_model(scratch / "bert-base-random", shape, primary[0])
    return {"minilm": primary, "bert_base": (second, name, weights)}


def _default_model() -> Path:
    from embedserve.archive.default_model import fetch_default_model

    return fetch_default_model()


def _tiny(path: Path) -> Path:
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(path, max_seq_length=64)


def random_model(path: Path, shape: dict, tokenizer_from: Path, seed: int = 0) -> Path:
    """A BERT of `shape` with random weights (stored in float16), the tokenizer of another model
    folder, and sentence-transformers files for mean pooling."""
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertModel

    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    # The largest id, not the count: a vocabulary may leave ids unused.
    vocab_size = 1 + max(Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True).values())
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, max_position_embeddings=512, type_vocab_size=2, **shape)
    BertModel(config).to(torch.float16).save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": shape["hidden_size"], "pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return path


def write_fp16_copy(source: Path, target: Path) -> Path:
    """`source` with every safetensors file in float16: all-MiniLM-L6-v2 is 87 MiB in fp32, 44 in fp16."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(source, target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx", "README.md"))
    for weights in source.rglob("*.safetensors"):
        with safe_open(str(weights), "pt") as f:
            metadata = f.metadata()
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        half = {key: t.half() if t.is_floating_point() else t for key, t in tensors.items()}
        save_file(half, str(target / weights.relative_to(source)), metadata=metadata)
    return target


def describe(path: Path, name: str, weights: str) -> dict:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    parameters, dtypes = 0, set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                parameters += int(np.prod(piece.get_shape()))
                dtypes.add(piece.get_dtype())
    return {"name": name, "weights": weights, "path": str(path),
            "stored_dtype": sorted(dtypes), "parameters": parameters,
            **{key: config.get(key) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "intermediate_size", "vocab_size")}}


# -- environment and ceilings ---------------------------------------------------------------------

def environment(cuda: bool) -> dict:
    import sentence_transformers
    import transformers

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
           "platform": platform.platform(), "cpus": available_cpus(), "torch": torch.__version__,
           "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__}
    if not cuda:
        return {**env, "gpu": None, "cpu": platform.processor() or platform.machine(), "torch_threads":
                torch.get_num_threads()}
    props = torch.cuda.get_device_properties(0)
    backends = torch.backends.cuda
    return {
        **env,
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "matmul_allow_tf32": backends.matmul.allow_tf32,
        "sdpa_enabled": {"flash": backends.flash_sdp_enabled(), "mem_efficient": backends.mem_efficient_sdp_enabled(),
                         "math": backends.math_sdp_enabled(),
                         "cudnn": getattr(backends, "cudnn_sdp_enabled", lambda: None)()},
        "sdpa_runs": sdpa_runs(),
    }


def sdpa_runs(head_dim: int = 32) -> dict:
    """Which SDPA kernels accept an fp16 attention with and without a padding mask (a BERT batch
    of mixed lengths carries one; a kernel that refuses it is never used for such a batch)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(8, 12, 128, head_dim, device="cuda", dtype=torch.float16)
    lengths = torch.randint(8, 129, (8,), device="cuda")
    mask = (torch.arange(128, device="cuda") < lengths[:, None])[:, None, None, :]  # (batch, 1, 1, keys)
    runs = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        row = {}
        for label, attn_mask in (("no_mask", None), ("padding_mask", mask)):
            try:
                with warnings.catch_warnings(), sdpa_kernel(backend):
                    warnings.simplefilter("ignore")
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=attn_mask)
                torch.cuda.synchronize()
                row[label] = True
            except Exception:  # a kernel that refuses the shape, mask or build, whatever the error
                row[label] = False
        runs[backend.name.lower()] = row
    return runs


def peak_flops(cuda: bool) -> dict:
    """The MFU denominator: the datasheet's dense fp16 tensor-core peak where the GPU is in the
    table, else the measured matmul rate; the measured rate is reported either way."""
    if not cuda:
        measured = matmul_gflops(available_cpus(), seconds=0.5) / 1e3
        return {"source": "measured: 1024^3 fp32 matmul (CPU)", "tflops": round(measured, 3),
                "measured_matmul_tflops": round(measured, 3)}
    measured = matmul_tflops()
    name = torch.cuda.get_device_name(0).lower()
    for key, tflops, label in PEAK_TFLOPS:
        if key in name:
            return {"source": f"datasheet: {label}, dense fp16/bf16 tensor core", "tflops": tflops,
                    "measured_matmul_tflops": round(measured, 1)}
    return {"source": "measured: 8192^3 fp16 matmul", "tflops": round(measured, 1),
            "measured_matmul_tflops": round(measured, 1)}


def matmul_tflops(size: int = 8192, repeats: int = 20) -> float:
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.float16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


# -- correctness ----------------------------------------------------------------------------------

def correctness(engines: dict[str, EmbeddingService], modes: list[str], texts: list[str],
                reference: np.ndarray) -> dict:
    """Each mode's vectors for the corpus, embedded in TorchServe-sized batches, against the
    reference; graphs also against eager at the same dtype."""
    vectors, rows = {}, {}
    for name in modes:
        engine = engines[name]
        before = _graph_counts(engine)
        vectors[name] = embed_batches(engine, texts)
        rows[name] = compare(vectors[name], reference)
        after = _graph_counts(engine)
        if after is not None:
            rows[name]["graph_replays"] = after[0] - before[0]
            rows[name]["eager_passes"] = after[1] - before[1]
            eager = _eager_twin(name, vectors)
            if eager is not None:
                rows[name]["vs_eager"] = compare(vectors[name], vectors[eager])
    return {"texts": len(texts), "batch": TORCHSERVE_BATCH, "modes": rows}


def embed_batches(engine: EmbeddingService, texts: list[str], batch: int = TORCHSERVE_BATCH) -> np.ndarray:
    ids = engine.preparer.token_ids(texts)
    return np.concatenate([engine.encoder.embed(ids[i : i + batch]).vectors.numpy()
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


def adversarial(engines: dict[str, EmbeddingService], reference: EmbeddingService, model_dir: Path) -> dict:
    """Shapes where graph replay could go wrong, each against the one-text reference and, for
    graphs, against the same passes run eagerly: padding rows beside one real row, the extremes
    of length in one pass, a small bucket replayed after a large one, and distinct inputs that
    must stay distinct. Engines are run in order: each eager twin before its graphs."""
    tokenizer = load_tokenizer(Path(model_dir) / "tokenizer.json")
    words, rng = vocabulary_words(tokenizer), random.Random(7)
    longest = min(256, reference.preparer.max_length)

    def text(tokens: int) -> str:
        return text_of_length(tokenizer, words, rng, min(tokens, longest))

    small, large, middle = text(12), text(longest), text(100)
    cases = {
        "one_row_in_large_bucket": [[middle]],
        "lengths_2_and_256_in_one_pass": [["", large]],  # "" is [CLS] [SEP]: 2 tokens
        "small_large_small_replays": [[small], [large], [small]],
        "distinct_inputs": [[text(n) for n in (5, 9, 14, 20, 27, 33, 41, 50, 64, 80, 97, 120, 150, 190, 230, 256)]],
    }
    results = {}
    for case, calls in cases.items():
        texts = [t for call in calls for t in call]
        expected = reference.encoder.embed(reference.preparer.token_ids(texts)).vectors.numpy()
        rows, outputs = {}, {}
        for name, engine in engines.items():
            before = _graph_counts(engine)
            outputs[name], passes = _embed_calls(engine, calls, one_pass=case.startswith("lengths"))
            rows[name] = {**compare(outputs[name], expected), "passes": passes}
            after = _graph_counts(engine)
            if after is not None:
                rows[name]["graph_replays"] = after[0] - before[0]
                rows[name]["vs_eager"] = compare(outputs[name], outputs[_eager_twin(name, outputs)])
            if case == "small_large_small_replays":
                rows[name]["repeat_max_abs_diff"] = float(np.abs(outputs[name][0] - outputs[name][2]).max())
            if case == "distinct_inputs":
                rows[name]["max_pairwise_cosine"] = _max_pairwise_cosine(outputs[name])
        results[case] = {"tokens": [len(ids) for ids in reference.preparer.token_ids(texts)], "modes": rows}
    return results


def _embed_calls(engine: EmbeddingService, calls: list[list[str]], one_pass: bool) -> tuple[np.ndarray, int]:
    encoder = engine.encoder
    measured = encoder.pass_overhead_tokens
    if one_pass:  # a pass so dear that the planner never splits
        encoder.pass_overhead_tokens = 10**9
    try:
        embedded = [encoder.embed(engine.preparer.token_ids(call)) for call in calls]
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
    runner = engine.encoder.graph_runner
    return None if runner is None else (runner.replays, runner.eager)


def _eager_twin(name: str, names) -> str | None:
    """The engine a graphs engine is checked against, the same passes run eagerly: float16_graphs
    and float16_graphs_large_bucket -> float16_eager, float16_packed_graphs -> float16_packed."""
    stem = name.split("_graphs")[0]
    return next((twin for twin in (f"{stem}_eager", stem) if twin in names), None)


# -- latency and throughput -----------------------------------------------------------------------

def latency(engines: dict[str, EmbeddingService], model_dir: Path, repeats: int, cuda: bool) -> list[dict]:
    """One text per call through `encoder.embed` (pad, copy in, forward, pool, copy out): the
    median of `repeats` calls, by wall clock and by CUDA events around the call."""
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    words, rng = vocabulary_words(tokenizer), random.Random(3)
    rows = []
    for tokens in LATENCY_TOKENS:
        text = text_of_length(tokenizer, words, rng, tokens)
        for name, engine in engines.items():
            ids = engine.preparer.token_ids([text])
            for _ in range(max(3, repeats // 20)):  # warm this shape up
                engine.encoder.embed(ids)
            wall, events = [], []
            for _ in range(repeats):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                began = time.perf_counter()
                engine.encoder.embed(ids)
                wall.append((time.perf_counter() - began) * 1e3)
                if cuda:
                    end.record()
                    end.synchronize()
                    events.append(start.elapsed_time(end))
            rows.append({"tokens": tokens, "input_tokens": len(ids[0]), "mode": name, "repeats": repeats,
                         "wall_ms": round(statistics.median(wall), 4),
                         "wall_p90_ms": round(float(np.percentile(wall, 90)), 4),
                         "event_ms": round(statistics.median(events), 4) if events else None})
    return rows


def saturation(engine: EmbeddingService, model_dir: Path, texts: list[str], device: str, dtype: str, best_of: int,
               peak: dict, reference: np.ndarray | None = None) -> dict:
    """The whole corpus in one `embed` call (the engine sorts and cuts it), fastest of `best_of`,
    with tokenizing timed apart; then sentence-transformers `encode` on the same texts."""
    tokenize_s, embed_s = float("inf"), float("inf")
    for _ in range(best_of):
        began = time.perf_counter()
        ids = engine.preparer.token_ids(texts)
        tokenize_s = min(tokenize_s, time.perf_counter() - began)
        began = time.perf_counter()
        embedded = engine.encoder.embed(ids)  # returns on the host: the device is done
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
    st, st_vectors = sentence_transformers_encode(model_dir, texts, device, dtype, best_of)
    result = {
        "dtype": dtype,
        "engine": ours,
        "sentence_transformers": st,
        "gflop_per_token": round(flops / 1e9, 5),
        "mfu": round(tokens_per_s * flops / (peak["tflops"] * 1e12), 4),
        "mfu_of_measured_matmul": round(tokens_per_s * flops / (peak["measured_matmul_tflops"] * 1e12), 4),
    }
    if reference is not None:  # sentence-transformers' own vectors against our fp32 reference
        shared = min(len(st_vectors), len(reference))
        result["sentence_transformers_vs_reference"] = compare(st_vectors[:shared], reference[:shared])
    return result


def packed_against_padded(packed: dict[str, EmbeddingService], padded: dict[str, EmbeddingService],
                          texts: list[str], best_of: int) -> dict:
    """The corpus in TorchServe-sized batches through packed and padded passes, in turns (the
    fastest of `best_of` each): real tokens/s, real / computed tokens, and each packed engine's
    ratio to each padded one."""
    engines = {**packed, **padded}
    first = next(iter(packed.values()))
    ids = first.preparer.token_ids(texts)
    batches = [ids[start:start + TORCHSERVE_BATCH] for start in range(0, len(ids), TORCHSERVE_BATCH)]
    best = dict.fromkeys(engines, float("inf"))
    computed = dict.fromkeys(engines, 0)
    for round_ in range(best_of):
        for name, engine in engines.items():
            began = time.perf_counter()
            runs = [engine.encoder.embed(batch) for batch in batches]  # each returns on the host
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
        host = stages.get("prepare_ms", 0.0) + stages.get("encode_ms", 0.0) if "prepare_ms" in stages \
            else wall * 1e3 - model_ms  # the report lacks the host stages: all time outside the model
        result["host_over_model"] = round(host / model_ms, 4)
    return result


# -- targets --------------------------------------------------------------------------------------

def check_targets(results: dict) -> list[dict]:
    cuda = results["device"] == "cuda"
    correctness = results["correctness"]
    modes = correctness["modes"]
    adversarial_rows = [row for case in correctness["adversarial"].values() for row in case["modes"].values()]
    min_cosine = {name: row["min_cosine"] for name, row in modes.items()}
    adversarial_min = min((row["min_cosine"] for row in adversarial_rows if row["min_cosine"] is not None),
                          default=None)
    nan_rows = sum(row["nan_rows"] for row in [*modes.values(), *adversarial_rows])
    graph_vs_eager = [row["vs_eager"] for row in [*modes.values(), *adversarial_rows] if "vs_eager" in row]
    replays = [row["graph_replays"] for row in adversarial_rows if "graph_replays" in row]
    graphs_cosine = min((row["min_cosine"] for row in graph_vs_eager), key=_worst_first, default=None)
    graphs_error = max((row.get("max_rel_error") for row in graph_vs_eager), key=_worst_last, default=None)
    graphs_equal = None if not graph_vs_eager else {"min_cosine": graphs_cosine, "max_rel_error": graphs_error}
    graphs_met = (graphs_cosine is not None and graphs_cosine >= GRAPHS_MIN_COSINE and graphs_error is not None
                  and graphs_error <= GRAPHS_MAX_REL_ERROR and all(replays))
    latency = {(row["tokens"], row["mode"]): row["wall_ms"] for row in results["latency"]}
    latency_ratio = latency[(16, "graphs")] / latency[(16, "eager")] if (16, "graphs") in latency else None
    minilm, bert = results["saturation"]["minilm"], results["saturation"]["bert_base"]
    st = minilm["sentence_transformers"]["by_batch_size"][str(ST_BATCH_SIZES[0])]["texts_per_s"]
    speedup = minilm["engine"]["texts_per_s_with_tokenizing"] / st
    host = results["handle"][mode_name(minilm["dtype"], False)].get("host_over_model")
    # On CUDA packed passes replay graphs over total tokens: their padding counts, as the issue asks.
    packed = results["packed"].get("packed_graphs") or results["packed"]["packed"]
    packed_speedup = results["packed"].get("packed_graphs", {}).get(f"over_{mode_name('float16', True)}")
    packed_replayed = results["engines"].get("float16_packed_graphs", {}).get("graphs_captured", 0) > 0
    return [
        _target("every mode: min cosine to the fp32 reference (corpus; adversarial cases)",
                {**min_cosine, "adversarial": adversarial_min}, ">= 0.999",
                all(v is not None and v >= 0.999 for v in [*min_cosine.values(), adversarial_min])),
        _target("rows with NaN or inf, every mode and case", nan_rows, "0", nan_rows == 0),
        _target("CUDA graphs equal eager (min cosine; largest error relative to the eager row; every adversarial "
                "case replayed a graph)", graphs_equal,
                f"min cosine >= {GRAPHS_MIN_COSINE}, max relative error <= {GRAPHS_MAX_REL_ERROR}", graphs_met, cuda),
        _target("graphs / eager batch-1 latency at 16 tokens (wall)", _round(latency_ratio), "<= 0.5",
                latency_ratio is not None and latency_ratio <= 0.5, cuda),
        _target(f"MiniLM in-process / sentence-transformers encode (batch {ST_BATCH_SIZES[0]}), mixed corpus, "
                "texts/s with tokenizing", round(speedup, 2), ">= 5", speedup >= 5, cuda),
        _target("BERT-base-sized MFU (datasheet peak)", bert["mfu"], ">= 0.35", bert["mfu"] >= 0.35, cuda),
        _target("handler host time (prepare + encode) / model time, TorchServe batches of 32",
                host, "<= 0.15", host is not None and host <= 0.15, cuda),
        _target("packed passes: real / computed tokens", packed["real_over_computed_tokens"], ">= 0.99",
                packed["real_over_computed_tokens"] >= 0.99),
        _target("packed / padded passes, both with graphs, real tokens/s, TorchServe batches of 32",
                packed_speedup, ">= 1.6", packed_speedup is not None and packed_speedup >= 1.6 and packed_replayed,
                cuda),
    ]


def _worst_first(value: float | None) -> float:
    """Sort key: None (every row NaN) before any cosine."""
    return float("-inf") if value is None else value


def _worst_last(value: float | None) -> float:
    """Sort key: None (every row NaN, or no such figure) after any error."""
    return float("inf") if value is None else value


def _target(name: str, measured, goal: str, met: bool, applicable: bool = True) -> dict:
    return {"target": name, "measured": measured, "goal": goal, "met": bool(met) if applicable else None,
            "applicable": applicable}


# -- plot -----------------------------------------------------------------------------------------

def plot(results: dict, output: Path) -> None:
    """Four panels: distance to the reference per mode, batch-1 latency, saturation against
    sentence-transformers, and the handler's time per TorchServe batch."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, ((accuracy, speed), (throughput, split)) = plt.subplots(2, 2, figsize=(13, 9))
    where = results["environment"].get("gpu") or "CPU"
    figure.suptitle(f"bench.gpu on {where}, {results['environment']['date']}")

    modes = results["correctness"]["modes"]
    distance = [max(1 - (row["min_cosine"] or 0), 1e-9) for row in modes.values()]
    accuracy.bar(list(modes), distance, color="tab:blue")
    accuracy.axhline(1e-3, color="red", linestyle="--", label="target: min cosine 0.999")
    accuracy.set_yscale("log")
    accuracy.set_title("1 - min cosine to the fp32 reference (lower is better)")
    accuracy.legend(fontsize=8)

    rows = results["latency"]
    lengths = sorted({row["tokens"] for row in rows})
    names = list(dict.fromkeys(row["mode"] for row in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next(r["wall_ms"] for r in rows if (r["tokens"], r["mode"]) == (n, name)) for n in lengths]
        speed.bar(np.arange(len(lengths)) + i * width, values, width, label=name)
    speed.set_xticks(np.arange(len(lengths)) + width * (len(names) - 1) / 2, [f"{n} tokens" for n in lengths])
    speed.set_ylabel("ms (median, wall)")
    speed.set_title("batch-1 latency of encoder.embed")
    speed.legend(fontsize=8)

    models = results["saturation"]
    series = {"engine": [m["engine"]["texts_per_s_with_tokenizing"] for m in models.values()]}
    for size in ST_BATCH_SIZES:
        series[f"sentence-transformers, batch {size}"] = [
            m["sentence_transformers"]["by_batch_size"][str(size)]["texts_per_s"] for m in models.values()]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        bars = throughput.bar(np.arange(len(models)) + i * width, values, width, label=label)
        if label == "engine":
            throughput.bar_label(bars, [f"MFU {m['mfu']:.0%}" for m in models.values()], fontsize=8)
    throughput.set_xticks(np.arange(len(models)) + width * (len(series) - 1) / 2,
                          [results["models"][role]["name"] for role in models], fontsize=8)
    throughput.set_ylabel("texts/s (mixed corpus, tokenizing included)")
    throughput.set_title(f"saturation, {next(iter(models.values()))['dtype']}")
    throughput.legend(fontsize=8)

    handled = results["handle"]
    bottom = np.zeros(len(handled))
    for stage in ("prepare", "model", "encode"):
        values = np.array([row["ms_per_batch"].get(stage, 0.0) for row in handled.values()])
        split.bar(list(handled), values, bottom=bottom, label=stage)
        bottom += values
    split.set_ylabel(f"ms per TorchServe batch of {TORCHSERVE_BATCH}")
    split.set_title("engine.handle: one-text JSON requests")
    split.legend(fontsize=8)

    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)


# -- helpers --------------------------------------------------------------------------------------

def _write_atomically(path: Path, text: str) -> None:
    """Write beside `path`, then rename: a run killed by its time limit mid-write leaves the
    previous checkpoint whole, never a truncated file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def _setting(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--set {item}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class PeakMemory:
    """The most device memory allocated at once within a window (an engine's start-up, a model's
    whole run). torch keeps one peak counter, and embedserve/handler/backends/cuda_graphs.py resets it before each
    bucket's warm-up to size that bucket: read at a window's end, the counter would hold only what
    followed the last reset. While active, every reset first folds the counter into each open
    window, so a window's peak is the largest over its stretches between resets.

    `cuda` is torch.cuda (or a stand-in with max_memory_allocated and reset_peak_memory_stats);
    None measures nothing (CPU): open and close return None."""

    RESET = "reset_peak_memory_stats"

    def __init__(self, cuda=None, modules: tuple = ()):
        self.cuda = cuda
        # Every module a caller may reach the reset through: torch.cuda and torch.cuda.memory.
        self.modules = modules or tuple(m for m in (cuda, getattr(cuda, "memory", None)) if m is not None)
        self.windows: dict[int, int] = {}
        self.patched: list[tuple[object, object]] = []
        self.original = getattr(cuda, self.RESET, None)
        self.opened = 0

    def __enter__(self) -> "PeakMemory":
        for module in self.modules:
            if hasattr(module, self.RESET):
                self.patched.append((module, getattr(module, self.RESET)))
                setattr(module, self.RESET, self._reset)
        return self

    def __exit__(self, *exc) -> None:
        for module, original in reversed(self.patched):
            setattr(module, self.RESET, original)
        self.patched.clear()

    def open(self) -> int | None:
        if self.cuda is None:
            return None
        self._reset()  # the window's first stretch starts here; open windows keep what came before
        self.opened += 1
        self.windows[self.opened] = 0
        return self.opened

    def close(self, window: int | None) -> int | None:
        """The window's peak in bytes, or None when nothing is measured."""
        if window is None:
            return None
        return max(self.windows.pop(window), self.cuda.max_memory_allocated())

    def _reset(self, device=None, *args, **kwargs) -> None:
        peak = self.cuda.max_memory_allocated(device)
        for window, highest in self.windows.items():
            self.windows[window] = max(highest, peak)
        self.original(device, *args, **kwargs)


def _mib(size: int | None) -> float | None:
    return None if size is None else round(size / 2**20, 1)


def _release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


_STARTED = time.perf_counter()


def _progress(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
