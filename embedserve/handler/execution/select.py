"""The one place that decides how a worker runs its passes: it builds the candidate backends
(embedserve/handler/backends/base.py), checks them, captures their CUDA graphs, and hands one to the encoder,
with the reasons for /info.

In order:
1. Engine: ONNX Runtime where the archive holds its export and the placement is a CPU in
   float32 or int8 (no compile, no packed passes: both need the torch model's own modules);
   torch otherwise, or as the `engine` setting forces.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoConfig

from embedserve.handler.backends.base import Backend
from embedserve.handler.backends.cuda_graphs import REPLAY_TOLERANCE, GraphRunner
from embedserve.handler.backends.onnx_runtime import OnnxTransformer, onnx_file
from embedserve.handler.backends.packed import PackedBackend
from embedserve.handler.backends.packed_graphs import PackedGraphRunner, token_ladder
from embedserve.handler.backends.padded import PaddedBackend
from embedserve.handler.execution.placement import Placement
from embedserve.handler.model.files import HeadModule, Pooling
from embedserve.handler.model.head import load_head
from embedserve.handler.model.loading import TorchTransformer, load_model
from embedserve.handler.model.packed_forward import VARLEN_FLASH, PackedTransformer, packed_support
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


@dataclass
class Selection:
    backend: Backend
    dimension: int  # of the pipeline's output vector
    reasons: dict[str, str] = field(default_factory=dict)  # engine, layout, cuda_graphs: why, for /info


def select_backend(model_dir: Path, settings: Settings, placement: Placement, parts: ModelParts) -> Selection:
    model_dir = Path(model_dir)
    engine, engine_reason = choose_engine(settings, placement, model_dir)
    reasons = {"engine": engine_reason}
    width = int(AutoConfig.from_pretrained(model_dir).hidden_size) * len(parts.pooling.modes)
    head, dimension = load_head(model_dir, parts.head, width, placement.device)
    padded_parts = dict(modes=parts.pooling.modes, head=head, pad_id=parts.pad_id, pad_multiple=placement.pad_multiple,
                        device=placement.device)
    if engine == "onnxruntime":
        transformer = OnnxTransformer(model_dir / onnx_file(placement.int8), placement.cpu_threads or 1,
                                      lend_threads=placement.lend_cpus)
        backend: Backend = PaddedBackend(transformer, facts={"engine": engine, "attention": "onnxruntime"},
                                         **padded_parts)
        reasons["layout"] = "padded: the ONNX Runtime engine runs padded passes"
    else:
        model = load_model(model_dir, device=placement.device, dtype=placement.dtype,
                           int8_fp32_layers=placement.int8_fp32_layers, compile=placement.compile)
        torch_transformer = TorchTransformer(model)
        padded = PaddedBackend(torch_transformer, facts={"engine": engine, "attention": torch_transformer.attention},
                               **padded_parts)
        backend, reasons["layout"] = _layout(padded, torch_transformer.model, placement, parts, head) \
            if placement.packed else (padded, "padded: the default")
        if placement.cuda_graphs:
            with torch.inference_mode():
                backend, reasons["cuda_graphs"] = with_graphs(backend, torch_transformer.model, placement, parts)
    log.info("backend: %s (%s)", backend.describe(), "; ".join(f"{key}: {why}" for key, why in reasons.items()))
    return Selection(backend, dimension, reasons)


def choose_engine(settings: Settings, placement: Placement, model_dir: Path | None) -> tuple[str, str]:
    """The engine that runs the transformer, and why; a forced engine that cannot run here is a
    settings error."""
    exported = model_dir is not None and (Path(model_dir) / onnx_file(placement.int8)).is_file()
    # int8 loads float32; packed passes run the torch model's own modules.
    onnx_fits = placement.device.type == "cpu" and placement.dtype == torch.float32 and not placement.compile \
        and not placement.packed
    if settings.engine == "onnxruntime":
        if not onnx_fits:
            raise ValueError("handler setting 'engine': onnxruntime runs float32 or int8 on a CPU (no compile, "
                             "no packed)")
        if not exported:
            raise ValueError(f"handler setting 'engine': onnxruntime needs the build's {onnx_file(placement.int8)}, "
                             "which the archive does not hold (rebuild it with --set engine=auto)")
        return "onnxruntime", "the engine setting"
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
        packed = PackedBackend(transformer, parts.pooling.modes, head)
        rows = _probe_rows(parts.pad_id, model.config.vocab_size, parts.max_positions or 512)
        floor = PACKED_MIN_COSINE[placement.dtype]
        try:
            with torch.inference_mode():
                cosine = float(torch.nn.functional.cosine_similarity(
                    packed.run(packed.prepare(rows, None)), padded.run(padded.prepare(rows, None))).min())
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
        # No bucket longer than the position embeddings: its warm-up would index past them.
        buckets = [b for b in placement.cuda_graph_buckets if b.length <= (parts.max_positions or b.length)]
        if not buckets:
            return backend, "none: no bucket within the position embeddings"
        runner = GraphRunner.capture(backend.pooled, buckets, **common)
    if not runner.graphs:
        return backend, "none: refused or dropped at start-up (see the worker's log)"
    return backend.with_graphs(runner), f"captured {len(runner.graphs)}"


def _probe_rows(pad_id: int, vocab_size: int, max_positions: int) -> list[list[int]]:
    """A few inputs of mixed lengths, random ids: one token, short, long, equal lengths."""
    generator = torch.Generator().manual_seed(0)
    lengths = [min(length, max_positions) for length in (1, 7, 7, 33, 130, 3)]
    return [[token if token != pad_id else pad_id + 1 for token in
             torch.randint(0, vocab_size, (length,), generator=generator).tolist()] for length in lengths]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
