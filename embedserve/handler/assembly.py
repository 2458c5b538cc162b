"""The composition root: settings, a model folder and a worker's slot in, a ready service out.

The one place the start-up sequence is written: settings -> placement -> load (model files,
tokenizer, encoder, cache, the task's slice) -> warm-up (it measures) -> work bound -> the service,
made in one step. The server's adapter, the tests, the archive's checks and the benchmarks all
start a service through `assemble`, so they run what a worker runs, and a new step reaches every
one of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from embedserve.handler.api.server import PLAIN, ServerProfile
from embedserve.handler.backends.base import PassCost
from embedserve.handler.execution.calibration import Speed
from embedserve.handler.execution.encoder import DenseRows, Encoder, HybridRows, SparseRows, TokenRows, finite_rows
from embedserve.handler.execution.placement import Placement, apply_placement, resolve_placement
from embedserve.handler.execution.select import ModelParts, select_backend
from embedserve.handler.inputs.image import ImageLimits, ImagePreparation, ImageReader
from embedserve.handler.model.chat_pairs import ChatPairTokenizer
from embedserve.handler.model.description import ModelDescription, Task
from embedserve.handler.model.files import describe_model, resolve_max_length
from embedserve.handler.model.inputs import plain_inputs
from embedserve.handler.model.pages import PageIds, prompt_bos
from embedserve.handler.model.tokenization import TextTokenizer, set_parallelism
from embedserve.handler.routes.describe import Description, info_body
from embedserve.handler.routes.openapi import service_document
from embedserve.handler.scheduling.admission import WORK_SHARE, work_budget
from embedserve.handler.scheduling.cache import EmbeddingCache, open_cache
from embedserve.handler.scheduling.planner import DEFAULT_PASS_OVERHEAD_TOKENS
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings
from embedserve.handler.tasks.base import RequestChecks, TaskSlice
from embedserve.handler.tasks.embed import EmbedTask
from embedserve.handler.tasks.hybrid import HybridTask
from embedserve.handler.tasks.multi_vector import MultiVectorTask
from embedserve.handler.tasks.pages import PagesTask
from embedserve.handler.tasks.score import ScoreTask
from embedserve.handler.tasks.sparse import SparseTask
from embedserve.handler.worker.cpu_lending import CpuLending

log = logging.getLogger(__name__)

WARMUP_TEXT = "Warm-up: the worker embeds this once before it reports ready."
# What a cached vector is, in the cache's keys: a change of meaning gets new keys, so a shared
# Redis never answers with an older version's vectors. 2: the encoder's output before the
# pipeline's final Normalize (unit vectors before, which `normalize: false` cannot undo). 3: every
# kind of row, each value self-describing (its kind and shapes before the float32 parts).
CACHED_VECTORS = "vectors-3"


def assemble(model_dir: str | Path, settings: Settings, *, model_name: str, gpu_id: int | None = None,
             workers: int = 1, cuda_available: bool | None = None, response_timeout_s: float | None = None,
             warm: bool | None = None, adjust_placement: Callable[[Placement], Placement] | None = None,
             server: ServerProfile = PLAIN, model_version: str = "1.0") -> EmbeddingService:
    """A service for the model in `model_dir`, on this worker's lot: its GPU (`gpu_id`, if any)
    and the `workers` that share the host's cores, behind `server` (its paths, for the OpenAPI
    document) at `model_version` (the URL's version segment).

    `warm` (default: the `warmup` setting) embeds once and measures the speed; with a measured
    speed, `response_timeout_s` bounds each batch's work (admission.py). `adjust_placement`
    changes the resolved placement before loading, for measurements that need another forward
    pass shape than a worker's."""
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    placement = resolve_placement(settings, gpu_id=gpu_id, workers=workers, cuda_available=cuda_available,
                                  model_dir=Path(model_dir))
    if adjust_placement is not None:
        placement = adjust_placement(placement)
    parts = load(model_dir, settings, placement, model_name)
    speed = warm_up(parts.encoder, parts.text) if (settings.warmup if warm is None else warm) else None
    tokens_per_second = speed.tokens_per_second if speed else None
    budget = work_budget(tokens_per_second, response_timeout_s) if response_timeout_s is not None else None
    if budget:
        log.info("this worker embeds about %d tokens/s; a batch holds at most %d tokens of work (%.0f%% of "
                 "the %.0f s response timeout)", tokens_per_second, budget.tokens, WORK_SHARE * 100,
                 response_timeout_s)
    openapi_url = server.versioned_url(model_name, model_version) + "/openapi.json"
    description = Description(partial(info_body, model=parts.model),
                              partial(service_document, server=server, version=model_version), openapi_url)
    return EmbeddingService(parts.work, parts.text, parts.encoder, settings, model_name, parts.cache, description,
                            tokens_per_second, budget)


@dataclass(frozen=True)
class Parts:
    """A service's parts built from the model's files, cold: nothing embedded yet."""
    model: ModelDescription
    encoder: Encoder
    text: EmbedTask
    work: TaskSlice
    cache: EmbeddingCache | None


def load(model_dir: str | Path, settings: Settings, placement: Placement, model_name: str) -> Parts:
    model = describe_model(model_dir).served_with(settings.pooling)
    set_parallelism(placement.tokenizer_threads)  # a GPU worker's share of the host's cores
    scoring = model.scoring
    # A causal reranker's chat template needs the Hugging Face tokenizer itself: loaded once, for both.
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir) if scoring and scoring.chat else None
    tokenizer = TextTokenizer(model_dir, lowercase=model.do_lower_case, hf_tokenizer=hf_tokenizer)
    max_length = resolve_max_length(settings.max_length, model.max_seq_length, tokenizer.model_max_length,
                                    model.usable_positions)
    plain_length = max_length  # an input of no type (a multi-vector model's per-type lengths may be longer)
    if model.multi_vector and not settings.max_length:
        max_length = min(model.multi_vector.longest(max_length), model.usable_positions or 10**9)
    parts = ModelParts(
        pooling=model.pooling,
        head=model.head,
        pad_id=tokenizer.pad_id,
        max_batch_size=settings.max_batch_size,
        max_positions=model.usable_positions,
        # The longest input the tokenizer assembles: max_length, or the special tokens alone should they be more.
        max_length=max(max_length, len(tokenizer.prefix) + len(tokenizer.suffix)),
        scoring=model.scoring,
        sparse=model.sparse,
        m3=model.m3,
        multi_vector=model.multi_vector is not None,
        towers=model.towers,
        pages=model.pages,
        attention_mask=tokenizer.gives_attention_mask,
        pads_left=tokenizer.pads_left,
    )
    # bge-m3's sparse weights leave out the tokenizer's cls, eos, pad and unk tokens, as FlagEmbedding does.
    unused = frozenset(tokenizer.role_ids[role] for role in ("cls", "eos", "pad", "unk") if role in tokenizer.role_ids)
    rows = SparseRows if model.sparse else partial(HybridRows, unused=unused) if model.m3 else \
        TokenRows if model.multi_vector else DenseRows
    encoder = _open_encoder(model_dir, settings, placement, parts, rows)
    default_prompt = settings.prompt or model.prompts.get(model.default_prompt_name or "", "")
    # Everything that changes a vector for the same token ids: weights (the revision hashes
    # the pipeline modules' too), how they run, and the pipeline after the transformer.
    runs, placement = encoder.describe(), encoder.placement  # in the dtype the engine trial chose
    dtype = f"int8:{runs['engine']}:" + ",".join(placement.int8_fp32_layers) if placement.int8 \
        else f"{placement.dtype}:{runs['engine']}"
    dtype += f":{runs['layout']}" + (f":images on {runs['image_engine']}" if "image_engine" in runs else "")
    # The cache keeps the rows of the model's kind (dense, sparse, token vectors, bge-m3's three) by its row class's
    # codec (`rows` is a row class, or a partial of one).
    cache = open_cache(
        settings, model_name=model_name, codec=getattr(rows, "func", rows).codec(encoder.dimension),
        identity=f"{CACHED_VECTORS}|{settings.revision}|{dtype}|{'/'.join(model.modules)}")
    checks = RequestChecks(tokenizer, settings, model_name=model_name, dimension=encoder.dimension,
                           max_length=max_length)
    # A page retriever's page ids, by its image tokens (model/pages.py).
    page_ids = PageIds.of(model.pages, tokenizer) if model.pages else None
    image_positions = model.towers.image_positions if model.towers else \
        len(page_ids(model.pages.image_tokens)) if page_ids else 0
    images = ImageReader(ImagePreparation(model_dir, image_positions), ImageLimits.of(settings),
                         url_hosts=settings.image_url_hosts, url_timeout_s=settings.image_url_timeout_s) \
        if model.reads_images else None
    text = EmbedTask(checks, prompts=model.prompts, default_prompt=default_prompt,
                     include_prompt=encoder.pooling.include_prompt, pooling=encoder.pooling.modes,
                     images=images if model.towers else None)
    work: TaskSlice = text
    if model.task is Task.SPARSE:
        query_weights = load_file(str(Path(model_dir) / "query_static" / "model.safetensors"))["weight"].numpy() \
            if model.sparse.static_query else None
        work = SparseTask(checks, prompts=model.prompts, default_prompt=default_prompt, include_prompt=True,
                          query_weights=query_weights)
    elif model.task is Task.MULTI_VECTOR and model.pages:
        work = PagesTask(checks, model.multi_vector, model.pages, images, page_ids,
                         bos=prompt_bos(model.pages, tokenizer), pad=tokenizer.token("pad"))
    elif model.task is Task.MULTI_VECTOR:
        work = MultiVectorTask(checks, model.multi_vector, model.prompts, plain_length)
    elif model.task is Task.HYBRID:
        work = HybridTask(checks, prompts=model.prompts, default_prompt=default_prompt,
                          include_prompt=encoder.pooling.include_prompt)
    elif model.task is not Task.EMBED:
        chat_pairs = ChatPairTokenizer(hf_tokenizer, scoring.chat) if hf_tokenizer is not None else None
        work = ScoreTask(checks, scoring, model.task, chat_pairs=chat_pairs, default_instruction=default_prompt)
    return Parts(model, encoder, text, work, cache)


def _open_encoder(model_dir: str | Path, settings: Settings, placement: Placement, parts: ModelParts,
                  rows: Callable[..., Any]) -> Encoder:
    """The worker's encoder: placed, its backend selected (embedserve/handler/execution/select.py), its pass prices at
    their defaults until warm-up measures them."""
    apply_placement(placement)
    selection = select_backend(Path(model_dir), settings, placement, parts)
    overhead = settings.pass_overhead_tokens or DEFAULT_PASS_OVERHEAD_TOKENS
    cost = PassCost(placement.max_batch_tokens, settings.max_batch_size, overhead, overhead)
    lending = CpuLending.join(placement.lend_cpus, placement.cpu_threads) if placement.lend_cpus else None
    return Encoder(selection.backend, cost, selection.placement, dimension=selection.dimension, pooling=parts.pooling,
                   pad_id=parts.pad_id, max_positions=parts.max_positions, lending=lending, reasons=selection.reasons,
                   rows=rows, images=selection.images)


def warm_up(encoder: Encoder, text: EmbedTask) -> Speed:
    """Embed once (a broken model fails here, not on a request), then measure the speed: the
    work bound's tokens per second and, unless set, what a forward pass costs the planner."""
    if not all(finite_rows(encoder.embed(plain_inputs(text.checks.text.token_ids([WARMUP_TEXT]))).vectors)):
        raise RuntimeError("warm-up embedding is not finite; the model weights are broken")
    speed = encoder.measure_speed()
    if not text.settings.pass_overhead_tokens:
        encoder.pass_overhead_tokens = speed.pass_overhead_tokens
        log.info("a forward pass costs as much as %d tokens here; the batch planner weighs passes by it",
                 encoder.pass_overhead_tokens)
    return speed


def with_work_bound(service: EmbeddingService, tokens_per_second: float, response_timeout_s: float
                    ) -> EmbeddingService:
    """`service` holding each batch to what `tokens_per_second` embeds in WORK_SHARE of the
    response timeout (what `assemble` does with the speed warm-up measures)."""
    return replace(service, tokens_per_second=tokens_per_second,
                   budget=work_budget(tokens_per_second, response_timeout_s))
