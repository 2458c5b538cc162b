"""The embedding engine: a batch of raw requests in, one response per request out.

Server-agnostic: TorchServe's adapter (ts_handler.py) only moves bytes and statuses in and out.
Each request is parsed, checked against the model and its limits, and tokenized on its own, so
a bad one becomes its own error response and takes no part in the forward pass. The inputs of
all good requests are embedded together and split back by span.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from handler.batching import DEFAULT_PASS_OVERHEAD_TOKENS, flatten
from handler.cache import EmbeddingCache, open_cache
from handler.codec import (
    ENCODING_FORMATS, EmbeddingRequest, Route, encode_embeddings, encode_error, encode_info, encode_tokens,
    parse_request,
)
from handler.encoder import Encoder, Placement, resolve_max_length
from handler.errors import RequestError, internal_error, out_of_memory, too_large, unavailable, unprocessable
from handler.metrics import BatchReport
from handler.model_files import ModelDescription, describe_model
from handler.model_files import Pooling as ModelPooling
from handler.pooling import l2_normalize
from handler.quantize import OUTPUT_DTYPES, SCALAR_DTYPES, quantize
from handler.settings import Settings
from handler.tokenization import TextTokenizer

log = logging.getLogger(__name__)

WARMUP_TEXT = "Warm-up: the worker embeds this once before it reports ready."


@dataclass(frozen=True)
class RawRequest:
    body: Any
    content_type: str | None = None
    url_path: str | None = None


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Job:
    """A valid embedding request, tokenized: model input ids per input."""
    request: EmbeddingRequest
    ids: list[list[int]]
    normalize: bool
    unpooled: int = 0  # first tokens of each input that pooling leaves out (an excluded prompt)


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # its tokens without special tokens: what truncation never cuts
    unpooled: int  # what pooling leaves out: 0 unless the Pooling module excludes the prompt


class EmbeddingEngine:
    def __init__(self, tokenizer: TextTokenizer, encoder: Encoder, settings: Settings, *, model_name: str,
                 max_length: int, prompts: dict[str, str], default_prompt: str, description: ModelDescription,
                 cache: EmbeddingCache | None = None):
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.settings = settings
        self.model_name = model_name
        self.max_length = max_length
        self.prompts = prompts
        self.default_prompt = default_prompt
        self.cache = cache
        self.description = description
        self._prompt_tokens = {text: self._measure_prompt(text) for text in {default_prompt, *prompts.values()}}

    @classmethod
    def load(cls, model_dir: str | Path, settings: Settings, placement: Placement, model_name: str) -> "EmbeddingEngine":
        description = describe_model(model_dir)
        tokenizer = TextTokenizer(model_dir, lowercase=description.do_lower_case)
        pooling = description.pooling or ModelPooling(("mean",))
        if settings.pooling != "auto":
            pooling = ModelPooling((settings.pooling,), include_prompt=pooling.include_prompt)
        description = replace(description, pooling=pooling)
        encoder = Encoder(
            model_dir, placement,
            pooling=pooling,
            head=description.head,
            pad_id=tokenizer.pad_id,
            max_batch_size=settings.max_batch_size,
            pass_overhead_tokens=settings.pass_overhead_tokens or DEFAULT_PASS_OVERHEAD_TOKENS,
            max_positions=description.usable_positions,
        )
        max_length = resolve_max_length(settings.max_length, description.max_seq_length,
                                         tokenizer.model_max_length, description.usable_positions)
        default_prompt = settings.prompt or description.prompts.get(description.default_prompt_name or "", "")
        # Everything that changes a vector for the same token ids: weights (the revision hashes
        # the pipeline modules' too), how they run, and the pipeline after the transformer.
        dtype = "int8:" + ",".join(placement.int8_fp32_layers) if placement.int8_fp32_layers is not None \
            else str(placement.dtype)
        cache = open_cache(settings, model_name=model_name, dimension=encoder.dimension,
                           identity=f"{settings.revision}|{dtype}|{'/'.join(description.modules)}")
        return cls(tokenizer, encoder, settings, model_name=model_name, max_length=max_length,
                   prompts=description.prompts, default_prompt=default_prompt, cache=cache, description=description)

    def _measure_prompt(self, text: str) -> Prompt:
        if not text:
            return Prompt("", 0, 0)
        return Prompt(text, tokens=len(self.tokenizer.body_ids([text])[0]),
                      unpooled=0 if self.encoder.pooling.include_prompt else self.tokenizer.prompt_length(text))

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Model input ids with the server's defaults (right truncation at max_length, no prompt)."""
        return [self.tokenizer.assemble(body, self.max_length, "right").ids for body in self.tokenizer.body_ids(texts)]

    def warmup(self) -> None:
        if not torch.isfinite(self.encoder.embed(self.token_ids([WARMUP_TEXT])).vectors).all():
            raise RuntimeError("warm-up embedding is not finite; the model weights are broken")
        if not self.settings.pass_overhead_tokens:
            self.encoder.pass_overhead_tokens = self.encoder.measure_pass_overhead()
            log.info("a forward pass costs as much as %d tokens here; the batch planner weighs passes by it",
                     self.encoder.pass_overhead_tokens)

    def info(self) -> dict[str, Any]:
        placement = self.encoder.placement
        return {
            "model_id": self.settings.model_id or self.model_name,
            "revision": self.settings.revision or None,
            "served_model_name": self.model_name,
            "model_type": "embedding",
            "model_dtype": "int8" if placement.int8_fp32_layers is not None else str(placement.dtype).removeprefix("torch."),
            "device": str(placement.device),
            "embedding_dimension": self.encoder.dimension,
            "max_input_length": self.max_length,
            "architecture": self.description.model_type,
            "pooling": self.encoder.pooling.name,
            "modules": self.description.modules,
            "normalize": self.settings.normalize,
            "auto_truncate": self.settings.truncate,
            "prompts": self.prompts,
            "default_prompt": self.default_prompt,
            "max_client_batch_size": self.settings.max_inputs_per_request,
            "max_input_chars": self.settings.max_input_chars,
            "max_tokens_per_request": self.settings.max_tokens_per_request,
            "max_batch_tokens": placement.max_batch_tokens,
            "max_batch_size": self.settings.max_batch_size,
            "pass_overhead_tokens": self.encoder.pass_overhead_tokens,
            "cache": {"memory_entries": self.settings.cache_entries if self.cache and self.cache.memory else 0,
                      "redis": bool(self.cache and self.cache.redis)},
            "output_dtypes": list(OUTPUT_DTYPES),
            "encoding_formats": list(ENCODING_FORMATS),
        }

    def handle(self, raw_requests: Sequence[RawRequest]) -> list[Response]:
        return self.handle_with_report(raw_requests)[0]

    def handle_with_report(self, raw_requests: Sequence[RawRequest]) -> tuple[list[Response], BatchReport]:
        report = BatchReport(requests=len(raw_requests), cache_enabled=self.cache is not None)
        clock = time.perf_counter()
        bodies: list[tuple[int, bytes] | None] = [None] * len(raw_requests)
        jobs: dict[int, _Job] = {}
        for index, raw in enumerate(raw_requests):
            request = None
            try:
                request = parse_request(raw.body, raw.content_type, raw.url_path)
                if request.route is Route.TEI_INFO:
                    bodies[index] = (200, encode_info(self.info()))
                elif request.route is Route.TEI_TOKENIZE:
                    bodies[index] = (200, self._tokenize(request))
                else:
                    jobs[index] = self._prepare(request)
            except RequestError as err:
                bodies[index] = _error_body(err, request.route) if request else (err.http_status, encode_error(err))
            except Exception as err:  # a bug met by one request must not fail its batch
                # The frames and the type, not the message, which may quote request text.
                log.error("request %d of the batch failed unexpectedly (%s):\n%s", index, type(err).__name__,
                          "".join(traceback.format_tb(err.__traceback__)))
                failure = internal_error()
                bodies[index] = _error_body(failure, request.route) if request else (500, encode_error(failure))
        report.prepare_ms, clock = _since(clock)

        ids, spans = flatten([job.ids for job in jobs.values()])
        if ids:
            unpooled = [job.unpooled for job in jobs.values() for _ in job.ids]
            vectors, unfit = self._embed(ids, unpooled, report) if self.cache is None else \
                self._embed_cached(ids, unpooled, report)
            report.model_ms, clock = _since(clock)
            for (index, job), span in zip(jobs.items(), spans):
                failed = [i - span.start for i in range(span.start, span.stop) if i in unfit]
                if failed:
                    bodies[index] = _error_body(_does_not_fit(job, failed[0]), job.request.route)
                else:
                    bodies[index] = (200, self._encode(job, vectors[span]))
            report.encode_ms, clock = _since(clock)
            report.inputs = len(ids)

        headers = {"x-batch-size": str(len(raw_requests))}
        for status, _ in bodies:
            report.statuses[status] = report.statuses.get(status, 0) + 1
        # Counts only: request text never reaches the logs.
        log.debug("batch: %s", report)
        return [Response(status, body, headers) for status, body in bodies], report

    def unavailable(self, raw_requests: Sequence[RawRequest], reason: str) -> list[Response]:
        """503 for every request: what a worker answers after its device failed."""
        body = encode_error(unavailable(f"{reason}; this worker is being replaced, retry the request"))
        return [Response(503, body, {"retry-after": "1"}) for _ in raw_requests]

    def _embed(self, ids: list[list[int]], unpooled: list[int], report: BatchReport
               ) -> tuple[torch.Tensor, frozenset[int]]:
        """Vectors in input order, and the inputs that did not fit in memory even alone."""
        embedded = self.encoder.embed(ids, unpooled if any(unpooled) else None)
        report.forward_passes += embedded.passes
        report.real_tokens += embedded.real_tokens
        report.padded_tokens += embedded.padded_tokens
        return embedded.vectors, embedded.too_large

    def _embed_cached(self, ids: list[list[int]], unpooled: list[int], report: BatchReport
                      ) -> tuple[torch.Tensor, frozenset[int]]:
        """Vectors from the cache where present; the model runs once per distinct missing input."""
        cache = self.cache
        keys = [cache.key(item, skip) for item, skip in zip(ids, unpooled)]
        lookup = cache.lookup(keys)
        missing = {key: i for i, key in enumerate(keys) if key not in lookup.found}  # first index per key
        computed: dict[bytes, np.ndarray] = {}
        failed_keys: set[bytes] = set()
        if missing:
            fresh, unfit = self._embed([ids[i] for i in missing.values()], [unpooled[i] for i in missing.values()],
                                       report)
            for position, (key, row) in enumerate(zip(missing, fresh.numpy())):
                if position in unfit:
                    failed_keys.add(key)
                else:
                    computed[key] = row.copy()  # rows, not views of one block
            report.cache_errors += cache.store(computed)
        report.cache_errors += lookup.errors
        for key in keys:
            if key in lookup.found:
                tier = "redis" if key in lookup.from_redis else "memory"
                report.cache_hits[tier] = report.cache_hits.get(tier, 0) + 1
            else:
                report.cache_misses += 1
        zeros = np.zeros(self.encoder.dimension, dtype=np.float32)
        rows = [lookup.found.get(key, computed.get(key, zeros)) for key in keys]
        return torch.from_numpy(np.stack(rows)), frozenset(i for i, key in enumerate(keys) if key in failed_keys)

    def _prepare(self, request: EmbeddingRequest) -> _Job:
        options = request.options
        normalize = self.settings.normalize if options.normalize is None else options.normalize
        self._check_limits(request)
        self._check_options(request, normalize)
        prompt = self._prompt(options.prompt_name)
        bodies = self._bodies(request, prompt.text)
        truncate = self.settings.truncate if options.truncate is None else options.truncate
        tokenized = [self.tokenizer.assemble(body, self.max_length, options.truncation_direction, keep=prompt.tokens)
                     for body in bodies]
        for i, item in enumerate(tokenized):
            if not truncate and item.full_length > self.max_length:
                raise too_large(
                    f"'{request.field}[{i}]' has {item.full_length} tokens; the limit is {self.max_length} "
                    "and truncation is off (send \"truncate\": true to cut it)",
                    param=f"{request.field}[{i}]")
        total = sum(len(item.ids) for item in tokenized)
        if total > self.settings.max_tokens_per_request:
            raise too_large(f"the request has {total} tokens; the limit is max_tokens_per_request="
                            f"{self.settings.max_tokens_per_request}", param=request.field)
        return _Job(request, [item.ids for item in tokenized], normalize, prompt.unpooled)

    def _check_limits(self, request: EmbeddingRequest) -> None:
        """Input count and characters per text, both before any tokenizing."""
        if len(request.inputs) > self.settings.max_inputs_per_request:
            raise too_large(f"'{request.field}' has {len(request.inputs)} inputs; the limit is "
                            f"max_inputs_per_request={self.settings.max_inputs_per_request}", param=request.field)
        limit = self.settings.max_input_chars
        for i, item in enumerate(request.inputs):
            if isinstance(item, str) and len(item) > limit:
                raise too_large(f"'{request.field}[{i}]' has {len(item)} characters; the limit is "
                                f"max_input_chars={limit}", param=f"{request.field}[{i}]")

    def _check_options(self, request: EmbeddingRequest, normalize: bool) -> None:
        options = request.options
        if options.dimensions is not None and options.dimensions > self.encoder.dimension:
            raise unprocessable(f"'dimensions' must be at most the model's dimension {self.encoder.dimension}, "
                                f"got {options.dimensions}", param="dimensions")
        if options.output_dtype in SCALAR_DTYPES and not normalize:
            raise unprocessable(f"'output_dtype' {options.output_dtype} quantizes the range [-1, 1] and needs "
                                "normalized embeddings; drop \"normalize\": false or use float/binary",
                                param="output_dtype")

    def _prompt(self, name: str | None) -> Prompt:
        if name is None:
            return self._prompt_tokens[self.default_prompt]
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none (the model defines no prompts)"
            raise unprocessable(f"unknown 'prompt_name' '{name}'; known: {known}", param="prompt_name")
        return self._prompt_tokens[self.prompts[name]]

    def _bodies(self, request: EmbeddingRequest, prompt: str) -> list[list[int]]:
        """Token ids without special tokens for each input, the prompt in front: `prompt + text`
        tokenized as one string, as sentence-transformers does. With a prompt, token-id inputs are
        the text they decode to, so that both forms of one text give the same vector."""
        texts: dict[int, str] = {}
        bodies: list[list[int] | None] = []
        for i, item in enumerate(request.inputs):
            if isinstance(item, str):
                texts[i] = prompt + item
                bodies.append(None)
                continue
            for j, token in enumerate(item):
                if token >= self.tokenizer.vocab_size:
                    raise unprocessable(f"'{request.field}[{i}][{j}]' is token id {token}, outside the "
                                        f"vocabulary of {self.tokenizer.vocab_size}",
                                        param=f"{request.field}[{i}][{j}]")
            if prompt:
                texts[i] = prompt + self.tokenizer.decode(item)
            bodies.append(None if prompt else list(item))
        for i, ids in zip(texts, self.tokenizer.body_ids(list(texts.values()))):
            bodies[i] = ids
        return bodies

    def _tokenize(self, request: EmbeddingRequest) -> bytes:
        self._check_limits(request)
        prompt = self._prompt(request.options.prompt_name).text
        texts = [prompt + text for text in request.inputs]
        return encode_tokens(self.tokenizer.tokens(texts, request.options.add_special_tokens))

    def _encode(self, job: _Job, vectors: torch.Tensor) -> bytes:
        """Matryoshka truncation first, then normalization, so truncated vectors are unit length."""
        options = job.request.options
        if options.dimensions is not None:
            vectors = vectors[:, : options.dimensions]
        if job.normalize:
            vectors = l2_normalize(vectors)
        return encode_embeddings(job.request, quantize(vectors.numpy(), options.output_dtype),
                                 model_name=self.model_name, prompt_tokens=sum(len(ids) for ids in job.ids))


def _does_not_fit(job: _Job, item: int) -> RequestError:
    return out_of_memory(
        f"'{job.request.field}[{item}]' ({len(job.ids[item])} tokens) does not fit in memory even alone; "
        "send it shorter or lower max_length", param=f"{job.request.field}[{item}]")


def _error_body(err: RequestError, route: Route) -> tuple[int, bytes]:
    err.tei = route.tei  # TEI routes answer in TEI's shape and statuses
    return err.http_status, encode_error(err)


def _since(clock: float) -> tuple[float, float]:
    """Milliseconds since `clock`, and the new clock."""
    now = time.perf_counter()
    return (now - clock) * 1000, now
