"""The composition root: settings, a model folder and a worker's slot in, a ready service out.

The one place the start-up sequence is written: settings -> placement -> load (model files,
tokenizer, encoder, cache, request preparer) -> warm-up -> work bound. The TorchServe adapter,
the tests, the archive's checks and the benchmarks all start a service through `assemble`, so
they run what a worker runs, and a new step reaches every one of them. The /info body lives here
too: it describes what was assembled.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoTokenizer

from embedserve.handler.api.codec import ENCODING_FORMATS
from embedserve.handler.api.prepare import RequestPreparer
from embedserve.handler.api.quantize import OUTPUT_DTYPES
from embedserve.handler.backends.base import PassCost
from embedserve.handler.execution.encoder import Encoder
from embedserve.handler.execution.faults import FaultInjectingBackend, FaultInjection
from embedserve.handler.execution.placement import Placement, apply_placement, resolve_placement
from embedserve.handler.execution.select import ModelParts, select_backend
from embedserve.handler.model.chat_pairs import ChatPairTokenizer
from embedserve.handler.model.files import ModelDescription, describe_model, resolve_max_length
from embedserve.handler.model.tokenization import TextTokenizer, set_parallelism
from embedserve.handler.scheduling.admission import WORK_SHARE, work_budget
from embedserve.handler.scheduling.cache import open_cache
from embedserve.handler.scheduling.planner import DEFAULT_PASS_OVERHEAD_TOKENS
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings
from embedserve.handler.worker.cpu_lending import CpuLending

log = logging.getLogger(__name__)

WARMUP_TEXT = "Warm-up: the worker embeds this once before it reports ready."
# What a cached vector is, in the cache's keys: a change of meaning gets new keys, so a shared
# Redis never answers with an older version's vectors. 2: the encoder's output before the
# pipeline's final Normalize (unit vectors before, which `normalize: false` cannot undo).
CACHED_VECTORS = "vectors-2"


def assemble(model_dir: str | Path, settings: Settings, *, model_name: str, gpu_id: int | None = None,
             workers: int = 1, cuda_available: bool | None = None, response_timeout_s: float | None = None,
             warm: bool | None = None, adjust_placement: Callable[[Placement], Placement] | None = None
             ) -> EmbeddingService:
    """A service for the model in `model_dir`, on this worker's lot: its GPU (`gpu_id`, if any)
    and the `workers` that share the host's cores.

    `warm` (default: the `warmup` setting) embeds once and measures the speed; with a measured
    speed, `response_timeout_s` bounds each batch's work (admission.py). `adjust_placement`
    changes the resolved placement before loading, for measurements that need another forward
    pass shape than a worker's."""
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    placement = resolve_placement(settings, gpu_id=gpu_id, workers=workers, cuda_available=cuda_available,
                                  model_dir=Path(model_dir))
    if adjust_placement is not None:
        placement = adjust_placement(placement)
    service = load(model_dir, settings, placement, model_name)
    if settings.warmup if warm is None else warm:
        warm_up(service)
    if response_timeout_s is not None:
        bound_work(service, response_timeout_s)
    faults = FaultInjection.from_env()
    if faults is not None:  # the tests' failures in a real worker, once it has warmed up
        encoder = service.encoder
        service = service.with_encoder(encoder.with_backend(FaultInjectingBackend(encoder.backend, faults)))
    return service


def load(model_dir: str | Path, settings: Settings, placement: Placement, model_name: str) -> EmbeddingService:
    """The service's parts built from the model's files, cold: nothing embedded yet."""
    description = describe_model(model_dir).served_with(settings.pooling)
    set_parallelism(placement.device.type == "cuda")  # a GPU worker's host cores idle while it computes
    scoring = description.scoring
    # A causal reranker's chat template needs the Hugging Face tokenizer itself: loaded once, for both.
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir) if scoring and scoring.chat else None
    tokenizer = TextTokenizer(model_dir, lowercase=description.do_lower_case, hf_tokenizer=hf_tokenizer)
    chat_pairs = ChatPairTokenizer(hf_tokenizer, scoring.chat) if hf_tokenizer is not None else None
    max_length = resolve_max_length(settings.max_length, description.max_seq_length,
                                    tokenizer.model_max_length, description.usable_positions)
    parts = ModelParts(
        pooling=description.pooling,
        head=description.head,
        pad_id=tokenizer.pad_id,
        max_batch_size=settings.max_batch_size,
        max_positions=description.usable_positions,
        # The longest input the tokenizer assembles: max_length, or the special tokens alone should they be more.
        max_length=max(max_length, len(tokenizer.prefix) + len(tokenizer.suffix)),
        scoring=description.scoring,
    )
    encoder = _open_encoder(model_dir, settings, placement, parts)
    default_prompt = settings.prompt or description.prompts.get(description.default_prompt_name or "", "")
    # Everything that changes a vector for the same token ids: weights (the revision hashes
    # the pipeline modules' too), how they run, and the pipeline after the transformer.
    runs, placement = encoder.describe(), encoder.placement  # in the dtype the engine trial chose
    dtype = f"int8:{runs['engine']}:" + ",".join(placement.int8_fp32_layers) if placement.int8 \
        else f"{placement.dtype}:{runs['engine']}"
    dtype += f":{runs['layout']}"
    cache = open_cache(settings, model_name=model_name, dimension=encoder.dimension,
                       identity=f"{CACHED_VECTORS}|{settings.revision}|{dtype}|{'/'.join(description.modules)}")
    preparer = RequestPreparer(tokenizer, settings, model_name=model_name, dimension=encoder.dimension,
                               max_length=max_length, prompts=description.prompts, default_prompt=default_prompt,
                               include_prompt=encoder.pooling.include_prompt, chat_pairs=chat_pairs)
    return EmbeddingService(preparer, encoder, settings, model_name=model_name, cache=cache,
                            info=partial(info, description=description), scoring=description.scoring)


def _open_encoder(model_dir: str | Path, settings: Settings, placement: Placement, parts: ModelParts) -> Encoder:
    """The worker's encoder: placed, its backend selected (embedserve/handler/execution/select.py), its pass prices at
    their defaults until warm-up measures them."""
    apply_placement(placement)
    selection = select_backend(Path(model_dir), settings, placement, parts)
    overhead = settings.pass_overhead_tokens or DEFAULT_PASS_OVERHEAD_TOKENS
    cost = PassCost(placement.max_batch_tokens, settings.max_batch_size, overhead, overhead)
    lending = CpuLending.join(placement.lend_cpus, placement.cpu_threads) if placement.lend_cpus else None
    return Encoder(selection.backend, cost, selection.placement, dimension=selection.dimension, pooling=parts.pooling,
                   pad_id=parts.pad_id, max_positions=parts.max_positions, lending=lending, reasons=selection.reasons)


def warm_up(service: EmbeddingService) -> None:
    """Embed once (a broken model fails here, not on a request), then measure the speed: the
    work bound's tokens per second and, unless set, what a forward pass costs the planner."""
    encoder = service.encoder
    if not torch.isfinite(encoder.embed(service.preparer.token_ids([WARMUP_TEXT])).vectors).all():
        raise RuntimeError("warm-up embedding is not finite; the model weights are broken")
    speed = encoder.measure_speed()
    service.tokens_per_second = speed.tokens_per_second
    if not service.settings.pass_overhead_tokens:
        encoder.pass_overhead_tokens = speed.pass_overhead_tokens
        log.info("a forward pass costs as much as %d tokens here; the batch planner weighs passes by it",
                 encoder.pass_overhead_tokens)


def bound_work(service: EmbeddingService, response_timeout_s: float) -> None:
    """Hold each batch's work to what this worker embeds in WORK_SHARE of the server's response
    timeout, at the speed measured at warm-up. Without a measured speed (warm-up off) only
    max_tokens_per_request bounds the work."""
    service.budget = work_budget(service.tokens_per_second, response_timeout_s)
    if service.budget:
        log.info("this worker embeds about %d tokens/s; a batch holds at most %d tokens of work (%.0f%% of "
                 "the %.0f s response timeout)", service.tokens_per_second, service.budget.tokens,
                 WORK_SHARE * 100, response_timeout_s)


def info(service: EmbeddingService, description: ModelDescription) -> dict[str, Any]:
    """The /info body (TEI's keys, and what this server adds): the model, how it runs, the limits."""
    settings, encoder, preparer, cache = service.settings, service.encoder, service.preparer, service.cache
    placement = encoder.placement
    return {
        "model_id": settings.model_id or service.model_name,
        "revision": settings.revision or None,
        "served_model_name": service.model_name,
        "model_type": _model_type(service, description),
        "task": service.task,
        "routes": [route.value for route in service.routes],
        "model_dtype": "int8" if placement.int8 else str(placement.dtype).removeprefix("torch."),
        "device": str(placement.device),
        **encoder.describe(),  # engine; "layout": padded or packed; the attention kernel; CUDA graphs
        "selected_by": encoder.reasons,
        "embedding_dimension": encoder.dimension,
        "max_input_length": preparer.max_length,
        "architecture": description.model_type,
        "pooling": encoder.pooling.name if service.scoring is None or not service.scoring.own_head else None,
        "modules": description.modules,
        "normalize": settings.normalize,
        "auto_truncate": settings.truncate,
        "prompts": preparer.prompts,
        "default_prompt": preparer.default_prompt,
        "max_client_batch_size": settings.max_inputs_per_request,
        "max_input_chars": settings.max_input_chars,
        "max_tokens_per_request": service.max_request_tokens,
        "max_batch_work_tokens": service.batch_work_tokens,
        "tokens_per_second": round(service.tokens_per_second) if service.tokens_per_second else None,
        "max_response_bytes": settings.max_response_bytes,
        "max_batch_tokens": placement.max_batch_tokens,
        "max_batch_size": settings.max_batch_size,
        "pass_overhead_tokens": encoder.pass_overhead_tokens,
        "cache": {"memory_entries": settings.cache_entries if cache and cache.memory else 0,
                  "redis": bool(cache and cache.redis)},
        "output_dtypes": list(OUTPUT_DTYPES),
        "encoding_formats": list(ENCODING_FORMATS),
    }


def _model_type(service: EmbeddingService, description: ModelDescription) -> Any:
    """TEI's model_type: "embedding", or {"reranker"|"classifier": {"id2label": ...}}."""
    scoring = description.scoring
    if scoring is None:
        return "embedding"
    kind = "reranker" if scoring.task == "rerank" else "classifier"
    return {kind: {"id2label": {str(i): label for i, label in enumerate(scoring.labels)}}}
