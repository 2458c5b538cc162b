"""The one place that decides how a worker runs its passes: it builds the candidate backends
(embedserve/handler/backends/base.py), checks them, captures their CUDA graphs, and hands one to the encoder,
with the reasons for /info.

In order:
1. Engine: ONNX Runtime where the archive holds its export and the placement is a CPU in
   float32 or int8 (no compile, no packed passes: both need the torch model's own modules);
   torch otherwise, or as the `engine` and `dtype` settings force. On a CPU with bfloat16 units,
   under `dtype: auto`, that float32 default is timed against the bfloat16 engines the build
   verified (torch, OpenVINO), and the fastest by a clear margin is served
   (embedserve/handler/execution/engine_trial.py).
2. Layout: padded; packed where asked for, supported by the architecture, and equal to the
   padded pass on a few inputs of mixed lengths at start-up (PACKED_MIN_COSINE); else padded,
   with the reason logged.
3. CUDA graphs, where asked for on a GPU: by (batch, length) bucket for padded passes
   (embedserve/handler/backends/cuda_graphs.py), by total tokens and input tier for packed ones
   (embedserve/handler/backends/packed_graphs.py), captured on the chosen backend's eager pass and handed to its
   twin that replays them. None where the capture machinery refuses or drops them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoConfig

from embedserve.handler.backends.base import Backend
from embedserve.handler.backends.cuda_graphs import REPLAY_TOLERANCE, Bucket, GraphRunner
from embedserve.handler.backends.onnx_runtime import (ONNX_FILE, TEXT_TOWER_ONNX_FILE, VISION_ONNX_FILE, OnnxImageTower,
                                                      OnnxTextTower, OnnxTransformer, onnx_file)
from embedserve.handler.backends.openvino_runtime import PAD_MULTIPLE as OPENVINO_PAD_MULTIPLE
from embedserve.handler.backends.openvino_runtime import OpenVinoImageTower, OpenVinoTransformer, \
    openvino_available
from embedserve.handler.backends.packed import PackedBackend
from embedserve.handler.backends.packed_graphs import PackedGraphRunner, token_ladder
from embedserve.handler.backends.padded import PaddedBackend
from embedserve.handler.backends.pages import PageBackend
from embedserve.handler.backends.vision import VisionBackend
from embedserve.handler.backends.vision_graphs import ImageGraphs
from embedserve.handler.execution.engine_trial import READ_FROM_RECORD, Candidate, bf16_challengers, choose, \
    shared_trial, time_candidates, time_image_towers, trial_key
from embedserve.handler.execution.placement import Placement
from embedserve.handler.model.description import HeadModule, M3Heads, Pages, Pooling, Scoring, SparsePooling, Towers
from embedserve.handler.model.head import load_head, logit_score_head
from embedserve.handler.model.m3 import M3Pooler, load_m3_heads
from embedserve.handler.model.pages import PageEncoder, PageQueries, load_pages_model
from embedserve.handler.model.multi_vector import MultiVectorPooler
from embedserve.handler.model.sparse import SpladePooler, masked_lm_parts
from embedserve.handler.model.inputs import ModelInput, plain_inputs
from embedserve.handler.model.loading import TorchTransformer, load_model
from embedserve.handler.model.packed_forward import VARLEN_FLASH, PackedTransformer, packed_support
from embedserve.handler.model.towers import ImageTower, TextFeed, TextTower
from embedserve.handler.settings import Settings

log = logging.getLogger(__name__)

# The least cosine, per input, between the packed and the padded pass at start-up: float
# rounding apart in float32, half precision's in float16 / bfloat16.
PACKED_MIN_COSINE = {torch.float32: 0.9999, torch.float16: 0.999, torch.bfloat16: 0.995}


@dataclass(frozen=True)
class ModelParts:
    """What select needs of the model besides its folder: its pipeline, and the token facts the
    tokenizer and the position table give."""
    pooling: Pooling
    head: Sequence[HeadModule]
    pad_id: int
    max_batch_size: int
    max_positions: int | None  # tokens per input the position embeddings allow; None for rotary models
    max_length: int  # the longest input the engine ever passes, special tokens included
    scoring: Scoring | None = None  # a reranker's or classifier's head: logits, no pooling
    sparse: SparsePooling | None = None  # a SPLADE model's pooling of its vocabulary logits
    m3: M3Heads | None = None  # bge-m3's sparse and ColBERT heads beside the dense pipeline
    multi_vector: bool = False  # a vector per token (ColBERT): the head runs on every token
    towers: Towers | None = None  # an image-text model: texts and images through their own towers
    pages: Pages | None = None  # a page retriever: queries and page images through one model
    attention_mask: bool = True  # the tokenizer gives the model one (a SigLIP tokenizer may not)
    pads_left: bool = False  # the tokenizer pads on the left (SigLIP 2's): a fixed-length text feed does too


@dataclass
class Selection:
    backend: Backend
    dimension: int  # of the pipeline's output vector
    placement: Placement  # the worker's, in the dtype the backend runs
    # engine, dtype, layout, cuda_graphs: why, for /info; "speeds": the engine trial's timings
    reasons: dict[str, Any] = field(default_factory=dict)
    images: Backend | None = None  # an image-text model's vision tower, beside `backend`'s text tower


def select_backend(model_dir: Path, settings: Settings, placement: Placement, parts: ModelParts) -> Selection:
    model_dir = Path(model_dir)
    if parts.towers:
        return _towers(model_dir, settings, placement, parts)
    if parts.pages:
        return _pages(model_dir, settings, placement, parts)
    engine, engine_reason = choose_engine(settings, placement, model_dir)
    default = Candidate(engine, placement.dtype)
    challengers, dtype_reason = bf16_challengers(settings, placement)
    if challengers:
        selection = _fastest(model_dir, settings, placement, parts, default, challengers)
        if selection.placement.dtype != default.dtype:
            engine_reason = selection.reasons["dtype"]
    else:
        selection = _build(model_dir, default, placement, parts)
        selection.reasons["dtype"] = dtype_reason
    selection.reasons = {"engine": engine_reason, "dtype": selection.reasons.pop("dtype"), **selection.reasons}
    log.info("backend: %s in %s (%s)", selection.backend.describe(), _name(selection.placement.dtype),
             "; ".join(f"{key}: {why}" for key, why in selection.reasons.items()))
    return selection


def _fastest(model_dir: Path, settings: Settings, placement: Placement, parts: ModelParts, default: Candidate,
             challengers: list[str]) -> Selection:
    """The fastest of the float32 default and the bfloat16 `challengers` here, timed by this
    worker or read from the first worker of the server that timed them
    (embedserve/handler/execution/engine_trial.py)."""
    candidates = [default] + [Candidate(engine, torch.bfloat16) for engine in challengers]
    if "openvino" in challengers and not openvino_available():
        log.warning("the archive lists OpenVINO among its bfloat16 engines, but the openvino package is not "
                    "installed (pip install embedserve[openvino]); it is not tried")
        candidates = [c for c in candidates if c.engine != "openvino"]
    names = [candidate.name for candidate in candidates]
    with shared_trial(trial_key(model_dir, settings, placement, names)) as trial:
        recorded = trial.recorded_choice(names)
        if recorded:
            selection = _build(model_dir, candidates[names.index(recorded)], placement, parts)
            selection.reasons.update(dtype=f"{trial.recorded['reason']}, {READ_FROM_RECORD}",
                                     speeds=trial.recorded["timings"])
            return selection
        built = {}
        for candidate in candidates:
            try:
                built[candidate.name] = _build(model_dir, candidate, placement, parts)
            except Exception as err:  # a challenger that cannot run here is not a reason not to start
                if candidate is default:
                    raise
                log.warning("%s is not tried: %s: %s", candidate.name, type(err).__name__, str(err)[:300])
        timings = time_candidates({name: chosen.backend for name, chosen in built.items()}, parts.pad_id,
                                  parts.max_positions)
        choice, reason = choose(timings, default.name)
        trial.record(choice, reason, timings)
    log.info("engine trial: %s; %s", reason, ", ".join(f"{name}: {t.tokens_per_s:.0f} tokens/s, one text "
                                                      f"{t.one_text_ms:.1f} ms" for name, t in timings.items()))
    selection = built.pop(choice)
    built.clear()  # the other candidates' models and sessions go now
    selection.reasons.update(dtype=reason, speeds={name: asdict(timing) for name, timing in timings.items()})
    return selection


def _build(model_dir: Path, candidate: Candidate, placement: Placement, parts: ModelParts) -> Selection:
    """`candidate`'s backend: its engine, in its dtype, padded or packed, with CUDA graphs where
    the placement asks for them."""
    placement = replace(placement, dtype=candidate.dtype)
    engine = candidate.engine
    reasons: dict[str, Any] = {}
    scoring = parts.scoring
    own_head = bool(scoring and scoring.own_head)
    sparse = parts.sparse
    if sparse and engine != "torch":
        raise ValueError(f"handler setting 'engine': a sparse (SPLADE) model runs on the torch engine, not {engine}: "
                         "its pooling reads the masked-language model's head, which the ONNX export leaves out")
    if own_head:  # the model's own head gives the logits: no pooling, no sentence-transformers head
        head, dimension, modes = None, len(scoring.labels), ()
    elif sparse:  # the masked-language model's head and SPLADE pooling, built with the model below
        head, dimension, modes = None, sparse.vocabulary, ()
    else:
        modes = parts.pooling.modes
        if scoring:  # a causal reranker: its LogitScore over the last token's state (its pooling)
            head, dimension = logit_score_head(model_dir, scoring.logit_score, placement.device), 1
        else:
            hidden = int(AutoConfig.from_pretrained(model_dir).hidden_size)
            head, dimension = load_head(model_dir, parts.head, hidden * len(modes), placement.device)
    padded_parts: dict[str, Any] = dict(modes=modes, head=head, pad_id=parts.pad_id,
                                        pad_multiple=placement.pad_multiple, device=placement.device,
                                        segments=bool(scoring and scoring.segments))
    if parts.multi_vector:  # ColBERT: the Dense modules on every token's state, after any engine's transformer
        padded_parts["token_pooling"] = MultiVectorPooler(head)
    if parts.m3:  # bge-m3: its heads read every token's state, after any engine's transformer
        padded_parts["token_pooling"] = M3Pooler(modes, head, *load_m3_heads(model_dir, parts.m3, hidden,
                                                                             placement.device))
    if engine in ("onnxruntime", "openvino"):
        if engine == "onnxruntime":
            transformer: Any = OnnxTransformer(model_dir / onnx_file(placement.int8), placement.cpu_threads or 1,
                                               lend_threads=placement.lend_cpus)
        else:
            transformer = OpenVinoTransformer(model_dir / ONNX_FILE, placement.cpu_threads or 1,
                                              lend_threads=placement.lend_cpus, dtype=placement.dtype)
            padded_parts["pad_multiple"] = max(placement.pad_multiple, OPENVINO_PAD_MULTIPLE)
        backend: Backend = PaddedBackend(transformer, facts={"engine": engine, "attention": engine}, **padded_parts)
        reasons["layout"] = f"padded: the {engine} engine runs padded passes"
    else:
        model = load_model(model_dir, device=placement.device, dtype=placement.dtype,
                           int8_fp32_layers=placement.int8_fp32_layers, compile=placement.compile,
                           scoring=own_head, masked_lm=sparse is not None)
        if sparse:
            model, mlm_head = masked_lm_parts(model)
            padded_parts["token_pooling"] = SpladePooler(mlm_head, sparse)
        torch_transformer = TorchTransformer(model)
        padded = PaddedBackend(torch_transformer, facts={"engine": engine, "attention": torch_transformer.attention},
                               **padded_parts)
        if placement.packed and (own_head or sparse or parts.m3 or parts.multi_vector):
            backend, reasons["layout"] = padded, "padded: packed passes pool token states with the Pooling modes; " \
                                                 "this model's head reads its own"
        else:
            backend, reasons["layout"] = _layout(padded, torch_transformer.model, placement, parts, head) \
                if placement.packed else (padded, "padded: the default")
        if placement.cuda_graphs and (sparse or parts.m3 or parts.multi_vector):
            reasons["cuda_graphs"] = "none: a sparse, hybrid or multi-vector model's passes run eagerly (outputs " \
                                     "per token)"
        elif placement.cuda_graphs:
            with torch.inference_mode():
                backend, reasons["cuda_graphs"] = with_graphs(backend, torch_transformer.model, placement, parts)
    return Selection(backend, dimension, placement, reasons)


def _eager_padded(settings: Settings, placement: Placement, runs_on: str) -> Placement:
    """An image model's placement: padded passes without CUDA graphs; the settings that take text
    encoders alone (another engine, int8, packed, compile) are a settings error saying `runs_on`."""
    if settings.engine not in ("auto", "torch") or placement.int8 or settings.packed is True or placement.compile:
        raise ValueError(f"{runs_on}, padded, without int8 or compile: handler settings 'engine' other than auto or "
                         "torch, 'dtype' int8, 'packed' and 'compile' apply to text encoders")
    return replace(placement, cuda_graphs=False, packed=False)


def _towers(model_dir: Path, settings: Settings, placement: Placement, parts: ModelParts) -> Selection:
    """An image-text model's two towers: texts in padded passes, images stacked; each through its
    ONNX export on ONNX Runtime on a CPU in float32 where the build made one (faster than torch
    eager there: backends/onnx_runtime.py), else through torch. With `cuda_graphs` on a GPU, a
    fixed-size vision tower replays CUDA graphs of its passes (backends/vision_graphs.py); texts
    run eagerly. The other engines and layouts take text encoders only: asked for, they are a
    settings error."""
    towers = parts.towers
    graphs_asked = placement.cuda_graphs and placement.device.type == "cuda"
    placement = _eager_padded(settings, placement, f"{towers.architecture} runs on the torch engine (its towers' "
                                                   "exports on ONNX Runtime on a CPU)")
    model = load_model(model_dir, device=placement.device, dtype=placement.dtype)
    feed = TextFeed(towers.text_length, parts.pad_id, parts.attention_mask, parts.pads_left)
    onnx = settings.engine == "auto" and placement.device.type == "cpu" and placement.dtype == torch.float32
    threads = dict(threads=placement.cpu_threads or 1, lend_threads=placement.lend_cpus)
    if onnx and (model_dir / TEXT_TOWER_ONNX_FILE).is_file():
        text: Any = OnnxTextTower(model_dir / TEXT_TOWER_ONNX_FILE, feed=feed, **threads)
        facts = {"engine": "onnxruntime", "attention": "onnxruntime"}
    else:
        text = TextTower(model, feed)
        facts = {"engine": "torch", "attention": text.attention}
    backend = PaddedBackend(text, modes=(), head=None, pad_id=parts.pad_id, pad_multiple=placement.pad_multiple,
                            device=placement.device, facts=facts)
    image_reasons: dict[str, Any] = {}
    if onnx and (model_dir / VISION_ONNX_FILE).is_file():
        size = int(model.config.vision_config.image_size)
        tower, image_reasons = _vision_tower(model_dir / VISION_ONNX_FILE, settings, placement, towers, size, threads)
    else:
        tower = ImageTower(model)
    graphs, graphs_reason = _vision_graphs(tower, model, placement, parts) if graphs_asked else \
        (None, "none: image-text towers run eagerly off a GPU")
    images = VisionBackend(tower, dtype=placement.dtype, device=placement.device, own_grid=towers.own_grid,
                           graphs=graphs)
    reasons = {"engine": f"{towers.architecture}'s text tower on {facts['engine']}, its vision tower on "
                         f"{images.describe()['engine']}" + ("" if onnx else " (ONNX Runtime runs them on a CPU in "
                                                                           "float32, engine auto)"),
               "dtype": "the placement's", **image_reasons, "layout": f"padded texts; {images.describe()['layout']}",
               "cuda_graphs": f"vision tower: {graphs_reason}; texts run eagerly"}
    log.info("backend: %s in %s, images on its vision tower (%s)", backend.describe(), _name(placement.dtype),
             images.describe()["engine"])
    return Selection(backend, towers.dimension, placement, reasons, images=images)


def _vision_graphs(tower: Any, model: torch.nn.Module, placement: Placement, parts: ModelParts
                   ) -> tuple[ImageGraphs | None, str]:
    """CUDA graphs of a fixed-size vision tower, one per batch size of the ladder within a pass's
    bounds, and why; none for a NaFlex tower (each image's grid is resized on the host)."""
    if parts.towers.own_grid:
        return None, "none: a variable-resolution tower resizes its position table per image on the host"
    vision = model.config.vision_config
    positions = parts.towers.image_positions
    batches = sorted({bucket.batch for bucket in placement.cuda_graph_buckets
                      if bucket.batch <= parts.max_batch_size and bucket.batch * positions <= placement.max_batch_tokens})
    if not batches:
        return None, "none: no batch size of cuda_graph_batches fits a pass"
    with torch.inference_mode():
        graphs = ImageGraphs.capture(tower, batches, shape=(vision.num_channels, vision.image_size, vision.image_size),
                                     positions=positions, dtype=placement.dtype, device=placement.device,
                                     max_bytes=placement.cuda_graph_max_bytes,
                                     tolerance=REPLAY_TOLERANCE[placement.dtype])
    if not graphs.graphs:
        return None, f"none: {graphs.graphs.why_none or 'none captured'}"
    return graphs, f"captured {len(graphs.graphs)}"


def _pages(model_dir: Path, settings: Settings, placement: Placement, parts: ModelParts) -> Selection:
    """A page retriever's one model: queries in padded passes, page images stacked (padded where
    their sizes vary, backends/pages.py), both through transformers' own forward on torch, eagerly
    (model/pages.py)."""
    pages = parts.pages
    placement = _eager_padded(settings, placement, f"{pages.architecture} runs on the torch engine")
    encoder = PageEncoder(load_pages_model(model_dir, pages.architecture, device=placement.device,
                                           dtype=placement.dtype), pages.family)
    queries = PaddedBackend(PageQueries(encoder), modes=(), head=None, pad_id=parts.pad_id,
                            pad_multiple=placement.pad_multiple, device=placement.device,
                            facts={"engine": "torch", "attention": PageQueries.attention},
                            token_pooling=MultiVectorPooler(None))
    images = PageBackend(encoder, dtype=placement.dtype, device=placement.device, pad_id=parts.pad_id)
    reasons = {"engine": f"{pages.architecture} on torch: queries and page images through one model",
               "dtype": "the placement's",
               "layout": "padded queries; page images stacked, padded where their sizes vary",
               "cuda_graphs": "none: a page retriever runs eagerly"}
    log.info("backend: %s in %s, page images on the same model", queries.describe(), _name(placement.dtype))
    return Selection(queries, pages.dimension, placement, reasons, images=images)


def _vision_tower(path: Path, settings: Settings, placement: Placement, towers: Towers, size: int,
                  threads: dict[str, int]) -> tuple[Any, dict[str, Any]]:
    """A CPU worker's vision tower, and why: the export on ONNX Runtime in float32, or on OpenVINO
    in bfloat16 where the build verified it (`cpu_bf16_engines`), the CPU has bf16 units and the
    engine trial finds it faster by the margin (execution/engine_trial.py: timed once a machine,
    as a text encoder's engines are). Texts stay on their float32 tower: a text is cheap beside
    an image. Only the tower served is loaded, but where this worker times both."""
    challengers, why = bf16_challengers(settings, placement)
    if "openvino" not in challengers:
        return OnnxImageTower(path, **threads), {"image_dtype": why or "auto: float32; the build verified no "
                                                                       "bfloat16 vision tower"}
    if not openvino_available():
        return OnnxImageTower(path, **threads), {"image_dtype": "auto: float32; the openvino package is not installed"}
    names = ["onnxruntime float32", "openvino bfloat16"]
    with shared_trial(trial_key(path.parent, settings, placement, ["images", *names])) as trial:
        recorded = trial.recorded_choice(names)
        if recorded:
            tower = OpenVinoImageTower(path, **threads) if recorded == names[1] else OnnxImageTower(path, **threads)
            return tower, {"image_dtype": f"{trial.recorded['reason']}, {READ_FROM_RECORD}",
                           "image_speeds": trial.recorded["timings"]}
        default, challenger = OnnxImageTower(path, **threads), OpenVinoImageTower(path, **threads)
        if challenger.dtype != torch.bfloat16:
            return default, {"image_dtype": "auto: float32; OpenVINO computes bfloat16 in float32 here"}
        timings = time_image_towers(dict(zip(names, (default, challenger))), size, towers.image_positions)
        choice, reason = choose(timings, names[0], one="image")
        trial.record(choice, reason, timings)
    log.info("engine trial of the vision tower: %s", reason)
    return (challenger if choice == names[1] else default), \
        {"image_dtype": reason, "image_speeds": {name: asdict(timing) for name, timing in timings.items()}}


def choose_engine(settings: Settings, placement: Placement, model_dir: Path | None) -> tuple[str, str]:
    """The engine that runs the transformer in the placement's dtype, and why; a forced engine
    that cannot run here is a settings error."""
    exported = model_dir is not None and (Path(model_dir) / onnx_file(placement.int8)).is_file()
    on_cpu = placement.device.type == "cpu" and not placement.compile and not placement.packed
    # int8 loads float32; packed passes run the torch model's own modules.
    onnx_fits = on_cpu and placement.dtype == torch.float32
    if settings.engine == "onnxruntime":
        if not onnx_fits:
            raise ValueError("handler setting 'engine': onnxruntime runs float32 or int8 on a CPU (no compile, "
                             "no packed)")
        if not exported:
            raise ValueError(f"handler setting 'engine': onnxruntime needs the build's {onnx_file(placement.int8)}, "
                             "which the archive does not hold (rebuild it with --set engine=auto)")
        return "onnxruntime", "the engine setting"
    if settings.engine == "openvino":
        if not on_cpu or placement.int8 or placement.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("handler setting 'engine': openvino runs float32 or bfloat16 on a CPU (no int8, "
                             "compile or packed)")
        if not exported:
            raise ValueError(f"handler setting 'engine': openvino needs the build's {ONNX_FILE}, which the archive "
                             "does not hold (rebuild it with --set engine=openvino)")
        if not openvino_available():
            raise ValueError("handler setting 'engine': openvino needs the openvino package "
                             "(pip install embedserve[openvino])")
        return "openvino", "the engine setting"
    if settings.engine == "torch":
        return "torch", "the engine setting"
    if onnx_fits and exported:
        dtype = "int8" if placement.int8 else "float32"
        return "onnxruntime", f"auto: a CPU in {dtype}, and the archive holds the export"
    why = "no ONNX export in the archive" if onnx_fits else \
        f"ONNX Runtime runs float32 or int8 on a CPU only (here {placement.device.type}, {_name(placement.dtype)}" \
        f"{', compile' if placement.compile else ''}{', packed' if placement.packed else ''})"
    return "torch", f"auto: {why}"


def _layout(padded: PaddedBackend, model: torch.nn.Module, placement: Placement, parts: ModelParts,
            head: torch.nn.Module | None) -> tuple[Backend, str]:
    """The packed backend if this model supports it and agrees with the padded one on a few
    inputs of mixed lengths; otherwise, with a log line saying why, the padded one."""
    reason = packed_support(model)
    if reason is None:
        transformer = PackedTransformer(model)
        packed = PackedBackend(transformer, padded.modes, head)
        rows = _probe_rows(parts.pad_id, model.config.vocab_size, parts.max_positions or 512)
        floor = PACKED_MIN_COSINE[placement.dtype]
        try:
            with torch.inference_mode():
                cosine = float(torch.nn.functional.cosine_similarity(
                    packed.run(packed.prepare(rows)), padded.run(padded.prepare(rows))).min())
        except Exception as err:  # e.g. an attention kernel this device or torch build lacks
            reason = f"its check failed ({type(err).__name__}: {str(err)[:200]})"
        else:
            if cosine >= floor:
                log.info("packed passes (attention: %s), verified against padded: min cosine %.6f",
                         transformer.attention_kernel, cosine)
                return packed, f"packed: verified against padded passes (min cosine {cosine:.6f})"
            reason = f"its vectors differ from the padded pass's (min cosine {cosine:.6f} < {floor})"
    log.warning("packed passes unavailable for this model: %s; passes are padded", reason)
    return padded, f"padded: packed passes unavailable ({reason})"


def with_graphs(backend: Backend, model: torch.nn.Module, placement: Placement,
                 parts: ModelParts) -> tuple[Backend, str]:
    """`backend`'s twin replaying CUDA graphs of its passes, captured on its eager pass; the
    backend itself where none is left, every pass then running eagerly."""
    common = dict(pad_id=parts.pad_id, vocab_size=model.config.vocab_size, device=placement.device,
                  max_bytes=placement.cuda_graph_max_bytes, tolerance=REPLAY_TOLERANCE[placement.dtype])
    if isinstance(backend, PackedBackend):
        kernel = backend.transformer.attention_kernel
        if kernel != VARLEN_FLASH:  # the grouped SDPA reads the offsets on the host: not capturable
            log.warning("packed passes run eagerly: CUDA graphs need the %s attention kernel; this worker's "
                        "is %s", VARLEN_FLASH, kernel)
            return backend, f"none: packed graphs need the {VARLEN_FLASH} attention kernel, not {kernel}"
        # Flash attention launches blocks for max_len tokens in every slot: the engine's limit,
        # which no input exceeds, not the position table's (a longer input's pass runs eagerly).
        max_len = parts.max_length or parts.max_positions or placement.max_batch_tokens
        largest = min(placement.max_batch_tokens, parts.max_batch_size * max_len)
        runner = PackedGraphRunner.capture(backend.run_eager, token_ladder(largest), max_inputs=parts.max_batch_size,
                                           max_len=max_len, **common)
    else:
        buckets = usable_buckets(placement.cuda_graph_buckets, parts.max_length, parts.max_positions)
        if not buckets:
            return backend, "none: no bucket within the position embeddings"
        runner = GraphRunner.capture(backend.pooled, buckets, **common)
    if not runner.graphs:
        return backend, f"none: {runner.graphs.why_none or 'none captured'}"
    return backend.with_graphs(runner), f"captured {len(runner.graphs)}"


def usable_buckets(buckets: Sequence[Bucket], max_length: int | None, max_positions: int | None) -> list[Bucket]:
    """The buckets a pass can use: none longer than the position embeddings (its warm-up would
    index past them), and none longer than the shortest that holds `max_length`, the longest input
    the engine ever passes (MiniLM cuts at 256: its 512-token buckets would hold memory and
    capture time and never replay)."""
    within = [b for b in buckets if b.length <= (max_positions or b.length)]
    holding = [b.length for b in within if max_length and b.length >= max_length]
    longest = min(holding) if holding else max((b.length for b in within), default=0)
    return [b for b in within if b.length <= longest]


def _probe_rows(pad_id: int, vocab_size: int, max_positions: int) -> list[ModelInput]:
    """A few inputs of mixed lengths, random ids: one token, short, long, equal lengths."""
    generator = torch.Generator().manual_seed(0)
    lengths = [min(length, max_positions) for length in (1, 7, 7, 33, 130, 3)]
    return plain_inputs([token if token != pad_id else pad_id + 1 for token in
                         torch.randint(0, vocab_size, (length,), generator=generator).tolist()] for length in lengths)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
