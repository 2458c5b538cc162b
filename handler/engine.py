"""The embedding engine: a batch of raw requests in, one response per request out.

Server-agnostic: TorchServe's adapter (ts_handler.py) only moves bytes and statuses in and out.
Each request is parsed and checked against the model and its limits on its own, so a bad one
becomes its own error response and takes no part in the forward pass. The texts of all good
requests are tokenized in one call, then each request's token limits are checked on its own;
the inputs of the requests that pass are embedded together and split back by span.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from handler.batching import DEFAULT_PASS_OVERHEAD_TOKENS, flatten
from handler.cache import EmbeddingCache, Lookup, open_cache
from handler.codec import (
    ENCODING_FORMATS, EmbeddingRequest, Route, encode_embeddings, encode_error, encode_info, encode_tokens,
    max_answer_bytes, parse_request,
)
from handler.encoder import DeviceFailure, Encoder, Placement, resolve_max_length
from handler.errors import (
    RequestError, internal_error, out_of_memory, overloaded, too_large, unavailable, unprocessable,
)
from handler.metrics import BatchReport
from handler.model_files import ModelDescription, describe_model
from handler.pooling import l2_normalize
from handler.quantize import OUTPUT_DTYPES, SCALAR_DTYPES, quantize
from handler.settings import Settings
from handler.tokenization import TextTokenizer, set_parallelism

log = logging.getLogger(__name__)

WARMUP_TEXT = "Warm-up: the worker embeds this once before it reports ready."
# The share of the response timeout one batch's work may take at the speed measured at warm-up.
# Real traffic runs slower than the measured full passes (padding about 10%, two workers sharing
# the memory bus about 15%: about 1.3x), so half the timeout keeps every batch well inside it:
# 120 s gives 60 s of measured work, about 80 s under full load. Measured on the default build: a
# request of 97% of the bound (152,653 mixed-length tokens) answered in 40 s, the idle core lent.
WORK_SHARE = 0.5
# Statuses a client should retry after a moment: a full work budget (429 on TEI routes).
RETRY_LATER = (429, 503)


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
class _Checked:
    """A valid embedding request before tokenizing: the texts it needs tokenized."""
    request: EmbeddingRequest
    normalize: bool
    prompt: Prompt
    texts: dict[int, str]  # input index -> prompt + text, for the tokenizer
    bodies: list[list[int] | None]  # token ids without special tokens; None where `texts` holds the input


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
        self.tokens_per_second: float | None = None  # measured at warm-up
        self.batch_work_tokens: int | None = None  # set by bound_batch_work
        self.response_timeout_s: float | None = None
        self._prompt_tokens = {text: self._measure_prompt(text) for text in {default_prompt, *prompts.values()}}

    @classmethod
    def load(cls, model_dir: str | Path, settings: Settings, placement: Placement, model_name: str) -> "EmbeddingEngine":
        description = describe_model(model_dir).served_with(settings.pooling)
        set_parallelism(placement.device.type == "cuda")  # a GPU worker's host cores idle while it computes
        tokenizer = TextTokenizer(model_dir, lowercase=description.do_lower_case)
        max_length = resolve_max_length(settings.max_length, description.max_seq_length,
                                         tokenizer.model_max_length, description.usable_positions)
        encoder = Encoder(
            model_dir, placement,
            pooling=description.pooling,
            head=description.head,
            pad_id=tokenizer.pad_id,
            max_batch_size=settings.max_batch_size,
            pass_overhead_tokens=settings.pass_overhead_tokens or DEFAULT_PASS_OVERHEAD_TOKENS,
            max_positions=description.usable_positions,
            # The longest input `assemble` makes: max_length, or the special tokens alone should they be more.
            max_length=max(max_length, len(tokenizer.prefix) + len(tokenizer.suffix)),
        )
        default_prompt = settings.prompt or description.prompts.get(description.default_prompt_name or "", "")
        # Everything that changes a vector for the same token ids: weights (the revision hashes
        # the pipeline modules' too), how they run, and the pipeline after the transformer.
        dtype = f"int8:{placement.engine}:" + ",".join(placement.int8_fp32_layers) if placement.int8 \
            else f"{placement.dtype}:{placement.engine}"
        dtype += f":{encoder.layout()['layout']}"
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
        speed = self.encoder.measure_speed()
        self.tokens_per_second = speed.tokens_per_second
        if not self.settings.pass_overhead_tokens:
            self.encoder.pass_overhead_tokens = speed.pass_overhead_tokens
            log.info("a forward pass costs as much as %d tokens here; the batch planner weighs passes by it",
                     self.encoder.pass_overhead_tokens)

    def bound_batch_work(self, response_timeout_s: float) -> None:
        """Hold each batch's work to what this worker embeds in WORK_SHARE of the server's
        response timeout, at the speed measured at warm-up: a batch that ran past the timeout
        would have its worker killed and every request of it failed. Without a measured speed
        (warm-up off) only max_tokens_per_request bounds the work."""
        if self.tokens_per_second:
            self.batch_work_tokens = int(self.tokens_per_second * response_timeout_s * WORK_SHARE)
            self.response_timeout_s = response_timeout_s
            log.info("this worker embeds about %d tokens/s; a batch holds at most %d tokens of work (%.0f%% of "
                     "the %.0f s response timeout)", self.tokens_per_second, self.batch_work_tokens,
                     WORK_SHARE * 100, response_timeout_s)

    @property
    def max_request_tokens(self) -> int:
        return min(self.settings.max_tokens_per_request, self.batch_work_tokens or self.settings.max_tokens_per_request)

    def info(self) -> dict[str, Any]:
        placement = self.encoder.placement
        return {
            "model_id": self.settings.model_id or self.model_name,
            "revision": self.settings.revision or None,
            "served_model_name": self.model_name,
            "model_type": "embedding",
            "model_dtype": "int8" if placement.int8 else str(placement.dtype).removeprefix("torch."),
            "device": str(placement.device),
            "engine": placement.engine,
            **self.encoder.layout(),  # "layout": padded or packed; the attention kernel; CUDA graphs
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
            "max_tokens_per_request": self.max_request_tokens,
            "max_batch_work_tokens": self.batch_work_tokens,
            "tokens_per_second": round(self.tokens_per_second) if self.tokens_per_second else None,
            "max_response_bytes": self.settings.max_response_bytes,
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
        checked: dict[int, _Checked] = {}
        for index, raw in enumerate(raw_requests):
            request = None
            try:
                request = parse_request(raw.body, raw.content_type, raw.url_path)
                if request.route is Route.TEI_INFO:
                    bodies[index] = (200, encode_info(self.info()))
                elif request.route is Route.TEI_TOKENIZE:
                    bodies[index] = (200, self._tokenize(request))
                else:
                    checked[index] = self._check(request)
            except RequestError as err:
                bodies[index] = _error_body(err, request.route) if request else (err.http_status, encode_error(err))
            except Exception as err:  # a bug met by one request must not fail its batch
                log_failure(f"preparing request {index} of the batch", err)
                failure = internal_error()
                bodies[index] = _error_body(failure, request.route) if request else (500, encode_error(failure))
        jobs = self._tokenize_checked(checked, bodies)
        report.prepare_ms, clock = _since(clock)

        jobs = self._admit(jobs, bodies)
        if jobs:
            embedded = self._embed_isolated(list(jobs.items()), report)
            report.model_ms, clock = _since(clock)
            embedded = self._shape_vectors(jobs, embedded)
            for index, job in jobs.items():
                outcome = embedded[index]
                bodies[index] = _error_body(outcome, job.request.route) if isinstance(outcome, RequestError) \
                    else self._encode_guarded(index, job, *outcome)
            report.encode_ms, clock = _since(clock)
            report.inputs = sum(len(job.ids) for job in jobs.values())

        headers = {"x-batch-size": str(len(raw_requests))}
        for status, _ in bodies:
            report.statuses[status] = report.statuses.get(status, 0) + 1
        # Counts only: request text never reaches the logs.
        log.debug("batch: %s", report)
        return [Response(status, body, {**headers, **({"retry-after": "1"} if status in RETRY_LATER else {})})
                for status, body in bodies], report

    def _tokenize_checked(self, checked: dict[int, _Checked], bodies: list[tuple[int, bytes] | None]
                          ) -> dict[int, _Job]:
        """The checked requests' texts tokenized in one call, then each request finished on its
        own: a request over a token limit is answered alone, the others go on."""
        texts = [text for pending in checked.values() for text in pending.texts.values()]
        try:
            tokenized = self.tokenizer.body_ids(texts) if texts else []
        except Exception:  # a text that breaks the tokenizer: tokenize each request alone to find its owner
            tokenized = None
        jobs: dict[int, _Job] = {}
        start = 0
        for index, pending in checked.items():
            stop = start + len(pending.texts)
            try:
                own = tokenized[start:stop] if tokenized is not None else \
                    self.tokenizer.body_ids(list(pending.texts.values()))
                jobs[index] = self._finish(pending, own)
            except RequestError as err:
                bodies[index] = _error_body(err, pending.request.route)
            except Exception as err:  # a bug met by one request must not fail its batch
                log_failure(f"preparing request {index} of the batch", err)
                bodies[index] = _error_body(internal_error(), pending.request.route)
            start = stop
        return jobs

    def _admit(self, jobs: dict[int, _Job], bodies: list[tuple[int, bytes] | None]) -> dict[int, _Job]:
        """The requests this batch's work budget holds, in arrival order; the others are answered
        503 with retry-after: they would have pushed the batch past the response timeout."""
        if self.batch_work_tokens is None:
            return jobs
        admitted, work = {}, 0
        for index, job in jobs.items():
            tokens = sum(len(ids) for ids in job.ids)
            if work + tokens > self.batch_work_tokens:
                bodies[index] = _error_body(overloaded(
                    f"this worker's batch already holds {work} of the {self.batch_work_tokens} tokens it may embed "
                    "within the response timeout; retry the request"), job.request.route)
                continue
            admitted[index] = job
            work += tokens
        return admitted

    def _embed_isolated(self, jobs: list[tuple[int, _Job]], report: BatchReport
                        ) -> dict[int, tuple[torch.Tensor, frozenset[int]] | RequestError]:
        """Each request's vectors and its inputs that did not fit in memory, or its error. A
        failure is traced to the requests that cause it by embedding the halves apart, so the
        others still get their vectors; a vector that is not finite fails its request (and was
        not cached). A device failure ends the batch: the worker is replaced."""
        ids, spans = flatten([job.ids for _, job in jobs])
        unpooled = [job.unpooled for _, job in jobs for _ in job.ids]
        try:
            vectors, unfit = self._embed(ids, unpooled, report) if self.cache is None else \
                self._embed_cached(ids, unpooled, report)
        except DeviceFailure:
            raise
        except Exception as err:
            if len(jobs) > 1:
                half = len(jobs) // 2
                return {**self._embed_isolated(jobs[:half], report), **self._embed_isolated(jobs[half:], report)}
            [(index, job)] = jobs
            log_failure(f"embedding request {index} of the batch", err)
            return {index: internal_error("the server failed to embed this request; the failure is logged")}
        finite = torch.isfinite(vectors).all(dim=1).tolist()
        outcomes: dict[int, tuple[torch.Tensor, frozenset[int]] | RequestError] = {}
        for (index, job), span in zip(jobs, spans):
            own_unfit = frozenset(i - span.start for i in unfit if span.start <= i < span.stop)
            broken = [i for i in range(span.stop - span.start) if not finite[span.start + i] and i not in own_unfit]
            if broken:
                log.error("request %d of the batch: the model gave a non-finite vector for its input %d",
                          index, broken[0])
                param = f"{job.request.field}[{broken[0]}]"
                outcomes[index] = internal_error(f"the model gave a non-finite vector for '{param}', which is never "
                                                 "served; the failure is logged", param=param)
            else:
                outcomes[index] = (vectors[span], own_unfit)
        return outcomes

    def _encode_guarded(self, index: int, job: _Job, vectors: torch.Tensor, unfit: frozenset[int]
                        ) -> tuple[int, bytes]:
        if unfit:
            return _error_body(_does_not_fit(job, min(unfit)), job.request.route)
        try:
            return 200, self._encode(job, vectors)
        except Exception as err:  # a bug met by one answer must not fail its batch
            log_failure(f"encoding the answer of request {index} of the batch", err)
            return _error_body(internal_error("the server failed to encode this answer; the failure is logged"),
                               job.request.route)

    def failed(self, raw_requests: Sequence[RawRequest]) -> list[Response]:
        """500 for every request: what a worker answers when a batch fails outside every guard."""
        body = encode_error(internal_error("the server failed to answer this batch; the failure is logged"))
        return [Response(500, body) for _ in raw_requests]

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
        try:
            lookup = cache.lookup(keys)
        except Exception as err:  # the cache is best effort: a bug in it costs hits, not answers
            log_failure("the cache lookup", err)
            lookup = Lookup(errors=1)
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
            try:
                report.cache_errors += cache.store(computed)
            except Exception as err:
                log_failure("storing in the cache", err)
                report.cache_errors += 1
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

    def _check(self, request: EmbeddingRequest) -> _Checked:
        """Every check before tokenizing: limits, options, prompt, token ids; and the texts to
        tokenize: `prompt + text`, tokenized as one string, as sentence-transformers does. With a
        prompt, token-id inputs are the text they decode to, so that both forms of one text give
        the same vector."""
        options = request.options
        normalize = self.settings.normalize if options.normalize is None else options.normalize
        self._check_limits(request)
        self._check_options(request, normalize)
        prompt = self._prompt(options.prompt_name)
        texts: dict[int, str] = {}
        bodies: list[list[int] | None] = []
        for i, item in enumerate(request.inputs):
            if isinstance(item, str):
                texts[i] = prompt.text + item
                bodies.append(None)
                continue
            for j, token in enumerate(item):
                if token >= self.tokenizer.vocab_size:
                    raise unprocessable(f"'{request.field}[{i}][{j}]' is token id {token}, outside the "
                                        f"vocabulary of {self.tokenizer.vocab_size}",
                                        param=f"{request.field}[{i}][{j}]")
            if prompt.text:
                texts[i] = prompt.text + self.tokenizer.decode(item)
            bodies.append(None if prompt.text else list(item))
        return _Checked(request, normalize, prompt, texts, bodies)

    def _finish(self, checked: _Checked, tokenized: list[list[int]]) -> _Job:
        """The checks after tokenizing, given the token ids of `checked.texts` in order: length
        per input (truncated, or refused with truncation off) and tokens per request."""
        request, prompt = checked.request, checked.prompt
        options = request.options
        bodies = list(checked.bodies)
        for i, ids in zip(checked.texts, tokenized):
            bodies[i] = ids
        truncate = self.settings.truncate if options.truncate is None else options.truncate
        assembled = [self.tokenizer.assemble(body, self.max_length, options.truncation_direction, keep=prompt.tokens)
                     for body in bodies]
        for i, item in enumerate(assembled):
            if not truncate and item.full_length > self.max_length:
                raise too_large(
                    f"'{request.field}[{i}]' has {item.full_length} tokens; the limit is {self.max_length} "
                    "and truncation is off (send \"truncate\": true to cut it)",
                    param=f"{request.field}[{i}]")
        total = sum(len(item.ids) for item in assembled)
        if total > self.settings.max_tokens_per_request:
            raise too_large(f"the request has {total} tokens; the limit is max_tokens_per_request="
                            f"{self.settings.max_tokens_per_request}", param=request.field)
        if total > self.max_request_tokens:
            raise too_large(f"the request has {total} tokens; this worker embeds about "
                            f"{self.tokens_per_second:.0f} tokens/s, so a request may hold at most "
                            f"{self.max_request_tokens} tokens to finish well within the server's "
                            f"{self.response_timeout_s:.0f} s response timeout; send fewer or shorter inputs per request",
                            param=request.field)
        return _Job(request, [item.ids for item in assembled], checked.normalize, prompt.unpooled)

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
        def answer_bytes(encoding_format: str) -> int:
            return max_answer_bytes(len(request.inputs), options.dimensions or self.encoder.dimension,
                                    options.output_dtype, encoding_format, self.model_name, request.route)

        answer = answer_bytes(options.encoding_format)
        if answer > self.settings.max_response_bytes:
            # base64 is no smaller for codes on the OpenAI route (4 bytes each): suggest it only where it helps.
            smaller = ", or \"encoding_format\": \"base64\"" if answer_bytes("base64") < answer else ""
            raise too_large(f"'{request.field}' has {len(request.inputs)} inputs, whose answer could take {answer} "
                            f"bytes; the server sends at most max_response_bytes={self.settings.max_response_bytes} "
                            f"per answer: send fewer inputs per request, fewer 'dimensions'{smaller}",
                            param=request.field)
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

    def _tokenize(self, request: EmbeddingRequest) -> bytes:
        self._check_limits(request)
        prompt = self._prompt(request.options.prompt_name).text
        texts = [prompt + text for text in request.inputs]
        return encode_tokens(self.tokenizer.tokens(texts, request.options.add_special_tokens))

    def _shape_vectors(self, jobs: dict[int, _Job],
                       outcomes: dict[int, tuple[torch.Tensor, frozenset[int]] | RequestError]
                       ) -> dict[int, tuple[torch.Tensor, frozenset[int]] | RequestError]:
        """Each request's vectors as it asked: Matryoshka truncation first, then normalization, so
        truncated vectors are unit length. The rows of all requests that ask for one `dimensions`
        are normalized together, in one operation."""
        groups: dict[int | None, list[int]] = {}
        for index, job in jobs.items():
            outcome = outcomes[index]
            if isinstance(outcome, RequestError):
                continue
            dimensions = job.request.options.dimensions
            if dimensions is not None:
                outcomes[index] = (outcome[0][:, :dimensions], outcome[1])
            if job.normalize:
                groups.setdefault(dimensions, []).append(index)
        for indices in groups.values():
            parts = [outcomes[index][0] for index in indices]
            try:
                normalized = l2_normalize(torch.cat(parts) if len(parts) > 1 else parts[0])
            except Exception as err:  # a bug met here fails these answers, not the batch
                log_failure("normalizing the embeddings of the batch", err)
                for index in indices:
                    outcomes[index] = internal_error("the server failed to encode this answer; the failure is logged")
                continue
            for index, rows in zip(indices, normalized.split([len(part) for part in parts])):
                outcomes[index] = (rows, outcomes[index][1])
        return outcomes

    def _encode(self, job: _Job, vectors: torch.Tensor) -> bytes:
        """The answer to `job`, its vectors already truncated and normalized (_shape_vectors)."""
        return encode_embeddings(job.request, quantize(vectors.numpy(), job.request.options.output_dtype),
                                 model_name=self.model_name, prompt_tokens=sum(len(ids) for ids in job.ids))


def _does_not_fit(job: _Job, item: int) -> RequestError:
    return out_of_memory(
        f"'{job.request.field}[{item}]' ({len(job.ids[item])} tokens) does not fit in memory even alone; "
        "send it shorter or lower max_length", param=f"{job.request.field}[{item}]")


def _error_body(err: RequestError, route: Route) -> tuple[int, bytes]:
    err.tei = route.tei  # TEI routes answer in TEI's shape and statuses
    return err.http_status, encode_error(err)


def log_failure(what: str, err: BaseException) -> None:
    """The frames and the type, not the message, which may quote request text."""
    log.error("%s failed unexpectedly (%s):\n%s", what, type(err).__name__,
              "".join(traceback.format_tb(err.__traceback__)))


def _since(clock: float) -> tuple[float, float]:
    """Milliseconds since `clock`, and the new clock."""
    now = time.perf_counter()
    return (now - clock) * 1000, now
