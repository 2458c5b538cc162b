"""The embedding service: a batch of raw requests in, one response per request out.

Server-agnostic: TorchServe's adapter (ts_handler.py) only moves bytes and statuses in and out.
The stages run in the request's order: parse and prepare each request (prepare.py), admit what
the batch's work budget holds (admission.py), embed the inputs of all admitted requests together,
through the cache where there is one, then shape and encode each answer (output.py). A fault of
one request is its own error response at every stage; `handle` never raises for one request.
assembly.py builds the service and its parts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from embedserve.handler.api.codec import (ALLOWED_METHOD, EMBEDDING_ROUTES, SCORING_ROUTES, EmbeddingRequest, Route,
                                          encode_error, encode_info, encode_tokens, parse_request, parse_route)
from embedserve.handler.api.errors import (METHOD_NOT_ALLOWED, RequestError, internal_error, not_found, overloaded,
                                           too_large, unavailable)
from embedserve.handler.api.scoring import ScoringRequest, parse_scoring
from embedserve.handler.api.openapi import ServedModel, openapi_document
from embedserve.handler.api.output import RETRY_LATER, Outcome, answer, error_body, shape_vectors
from embedserve.handler.api.prepare import Checked, Job, RequestPreparer
from embedserve.handler.execution.encoder import Encoder
from embedserve.handler.execution.faults import DeviceFailure
from embedserve.handler.model.files import EMBED, RERANK, Scoring
from embedserve.handler.scheduling.admission import WorkBudget, admit, max_request_tokens
from embedserve.handler.scheduling.cache import EmbeddingCache, embed_cached
from embedserve.handler.scheduling.planner import flatten
from embedserve.handler.settings import Settings
from embedserve.handler.worker.failures import log_failure
from embedserve.handler.worker.metrics import BatchReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawRequest:
    body: Any
    content_type: str | None = None
    url_path: str | None = None
    method: str | None = None  # None where the server does not say (TorchServe; codec.check_method)


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class EmbeddingService:
    def __init__(self, preparer: RequestPreparer, encoder: Encoder, settings: Settings, *, model_name: str,
                 cache: EmbeddingCache | None, info: Callable[[EmbeddingService], dict[str, Any]],
                 scoring: Scoring | None = None):
        """`info`: the /info body of a service, given by whoever assembled it and knows its parts.
        `scoring`: a reranker's or classifier's head (labels, activation); None for embeddings."""
        self.scoring = scoring
        self.preparer = preparer
        self.encoder = encoder
        self.settings = settings
        self.model_name = model_name
        self.cache = cache
        self._info = info
        self.tokens_per_second: float | None = None  # measured at warm-up
        self.budget: WorkBudget | None = None  # each batch's work; None until bound after warm-up
        self.model_version = "1.0"  # the URL's version segment, for the OpenAPI document's paths
        self._openapi: bytes | None = None

    def with_encoder(self, encoder: Encoder) -> "EmbeddingService":
        """This service's twin, embedding through `encoder` (its measured speed and work budget kept)."""
        twin = EmbeddingService(self.preparer, encoder, self.settings, model_name=self.model_name, cache=self.cache,
                                info=self._info, scoring=self.scoring)
        twin.tokens_per_second, twin.budget = self.tokens_per_second, self.budget
        twin.model_version = self.model_version
        return twin

    @property
    def task(self) -> str:
        """embed, rerank or classify: what the model serves."""
        return self.scoring.task if self.scoring else EMBED

    @property
    def routes(self) -> tuple[Route, ...]:
        """The routes that use this model (besides info, tokenize and openapi.json)."""
        if self.task == EMBED:
            return EMBEDDING_ROUTES
        return SCORING_ROUTES if self.task == RERANK else (Route.TEI_PREDICT,)

    def _parse(self, raw: RawRequest) -> EmbeddingRequest | ScoringRequest:
        """The request, refused with 404 on a route of another task (an embedding route on a
        reranker, or the reverse), naming the routes this model serves."""
        route = parse_route(raw.url_path)
        if (route.scoring or route in EMBEDDING_ROUTES) and route not in self.routes:
            served = ", ".join(f"'{r.value}'" for r in self.routes)
            err = not_found(f"this model is a {self.task} model: '{route.value}' is not served here; its routes are "
                            f"{served} (and 'info', 'tokenize', 'openapi.json')")
            err.tei = route.tei
            raise err
        if route.scoring:
            return parse_scoring(raw.body, raw.content_type, route, raw.method)
        return parse_request(raw.body, raw.content_type, raw.url_path, raw.method)

    @property
    def batch_work_tokens(self) -> int | None:
        return self.budget.tokens if self.budget else None

    @property
    def max_request_tokens(self) -> int:
        return max_request_tokens(self.settings.max_tokens_per_request, self.budget)

    def info(self) -> dict[str, Any]:
        return self._info(self)

    def openapi(self) -> dict[str, Any]:
        """The OpenAPI document of this service's routes, with its model's real values and limits."""
        preparer = self.preparer
        return openapi_document(ServedModel(
            name=self.model_name, version=self.model_version, dimension=preparer.dimension,
            max_length=preparer.max_length, vocab_size=preparer.tokenizer.vocab_size,
            prompts=tuple(sorted(preparer.prompts)), settings=self.settings,
            max_tokens_per_request=self.max_request_tokens, task=self.task,
            labels=self.scoring.labels if self.scoring else (),
            instructed=bool(self.scoring and self.scoring.chat)))

    def _openapi_body(self) -> bytes:
        # Built on first use: the limits are final once the worker has measured its speed.
        if self._openapi is None:
            self._openapi = encode_info(self.openapi())
        return self._openapi

    def _tokens_body(self, request: EmbeddingRequest) -> bytes:
        """/tokenize's answer, refused when larger than TorchServe passes on (it would drop the
        worker): its size is known only once built, about 60 bytes a token."""
        body = encode_tokens(self.preparer.tokens(request))
        if len(body) > self.settings.max_response_bytes:
            raise too_large(f"the answer lists the tokens of '{request.field}' in {len(body)} bytes; the server "
                            f"sends at most max_response_bytes={self.settings.max_response_bytes} per answer: "
                            "send fewer or shorter inputs", param=request.field)
        return body

    def handle(self, raw_requests: Sequence[RawRequest]) -> list[Response]:
        return self.handle_with_report(raw_requests)[0]

    def handle_with_report(self, raw_requests: Sequence[RawRequest]) -> tuple[list[Response], BatchReport]:
        report = BatchReport(requests=len(raw_requests), cache_enabled=self.cache is not None, task=self.task)
        clock = time.perf_counter()
        bodies: list[tuple[int, bytes] | None] = [None] * len(raw_requests)
        checked: dict[int, Checked] = {}
        scoring_jobs: dict[int, Job] = {}
        for index, raw in enumerate(raw_requests):
            request = None
            try:
                request = self._parse(raw)
                if isinstance(request, ScoringRequest):
                    scoring_jobs[index] = self.preparer.prepare_scoring(request, self.budget)
                elif request.route is Route.TEI_INFO:
                    bodies[index] = (200, encode_info(self.info()))
                elif request.route is Route.OPENAPI:
                    bodies[index] = (200, self._openapi_body())
                elif request.route is Route.TEI_TOKENIZE:
                    bodies[index] = (200, self._tokens_body(request))
                else:
                    checked[index] = self.preparer.check(request)
            except RequestError as err:
                bodies[index] = error_body(err, request.route) if request else (err.http_status, encode_error(err))
            except Exception as err:  # a bug met by one request must not fail its batch
                log_failure(f"preparing request {index} of the batch", err)
                failure = internal_error()
                bodies[index] = error_body(failure, request.route) if request else (500, encode_error(failure))
        jobs: dict[int, Job] = {}
        for index, outcome in self.preparer.tokenize(checked, self.budget).items():
            if isinstance(outcome, RequestError):
                bodies[index] = error_body(outcome, checked[index].request.route)
            else:
                jobs[index] = outcome
        jobs = dict(sorted({**jobs, **scoring_jobs}.items()))  # in arrival order, for admission
        report.prepare_ms, clock = _since(clock)

        jobs = self._admit(jobs, bodies)
        if jobs:
            embedded = self._embed_isolated(list(jobs.items()), report)
            report.model_ms, clock = _since(clock)
            embedded = shape_vectors(jobs, embedded)
            for index, job in jobs.items():
                bodies[index] = answer(index, job, embedded[index], self.model_name, self.scoring)
            report.encode_ms, clock = _since(clock)
            report.inputs = sum(len(job.ids) for job in jobs.values())

        headers = {"x-batch-size": str(len(raw_requests))}
        for status, _ in bodies:
            report.statuses[status] = report.statuses.get(status, 0) + 1
        # Counts only: request text never reaches the logs.
        log.debug("batch: %s", report)
        return [Response(status, body, {**headers, **_status_headers(status)}) for status, body in bodies], report

    def _admit(self, jobs: dict[int, Job], bodies: list[tuple[int, bytes] | None]) -> dict[int, Job]:
        """The requests this batch's work budget holds, in arrival order; the others are answered
        503 with retry-after: they would have pushed the batch past the response timeout."""
        admission = admit({index: job.tokens for index, job in jobs.items()}, self.budget)
        for index, held in admission.refused.items():
            bodies[index] = error_body(overloaded(
                f"this worker's batch already holds {held} of the {self.budget.tokens} tokens it may embed "
                "within the response timeout; retry the request"), jobs[index].request.route)
        return {index: jobs[index] for index in admission.admitted}

    def _embed_isolated(self, jobs: list[tuple[int, Job]], report: BatchReport) -> dict[int, Outcome]:
        """Each request's vectors and its inputs that did not fit in memory, or its error. A
        failure is traced to the requests that cause it by embedding the halves apart, so the
        others still get their vectors; a vector that is not finite fails its request (and was
        not cached). A device failure ends the batch: the worker is replaced."""
        ids, spans = flatten([job.ids for _, job in jobs])
        unpooled = [job.unpooled for _, job in jobs for _ in job.ids]
        second = [start for _, job in jobs for start in (job.second or [0] * len(job.ids))]
        try:
            vectors, unfit = self._embed(ids, unpooled, second, report) if self.cache is None else \
                self._embed_cached(ids, unpooled, second, report)
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
        outcomes: dict[int, Outcome] = {}
        for (index, job), span in zip(jobs, spans):
            own_unfit = frozenset(i - span.start for i in unfit if span.start <= i < span.stop)
            broken = [i for i in range(span.stop - span.start) if not finite[span.start + i] and i not in own_unfit]
            if broken:
                log.error("request %d of the batch: the model gave a non-finite vector for its input %d",
                          index, broken[0])
                param = job.request.param(broken[0])
                outcomes[index] = internal_error(f"the model gave a non-finite vector for '{param}', which is never "
                                                 "served; the failure is logged", param=param)
            else:
                outcomes[index] = (vectors[span], own_unfit)
        return outcomes

    def _embed(self, ids: list[list[int]], unpooled: list[int], second: list[int], report: BatchReport
               ) -> tuple[torch.Tensor, frozenset[int]]:
        """Vectors (a scoring model's logits) in input order, and the inputs that did not fit in
        memory even alone."""
        embedded = self.encoder.embed(ids, unpooled if any(unpooled) else None, second if any(second) else None)
        report.forward_passes += embedded.passes
        report.real_tokens += embedded.real_tokens
        report.padded_tokens += embedded.padded_tokens
        return embedded.vectors, embedded.too_large

    def _embed_cached(self, ids: list[list[int]], unpooled: list[int], second: list[int], report: BatchReport
                      ) -> tuple[torch.Tensor, frozenset[int]]:
        def embed(missing_ids: list[list[int]], missing_unpooled: list[int], missing_second: list[int]
                  ) -> tuple[np.ndarray, frozenset[int]]:
            vectors, unfit = self._embed(missing_ids, missing_unpooled, missing_second, report)
            return vectors.numpy(), unfit

        rows, unfit = embed_cached(self.cache, ids, unpooled, second, embed, report, self.encoder.dimension)
        return torch.from_numpy(rows), unfit

    def failed(self, raw_requests: Sequence[RawRequest]) -> list[Response]:
        """500 for every request: what a worker answers when a batch fails outside every guard."""
        body = encode_error(internal_error("the server failed to answer this batch; the failure is logged"))
        return [Response(500, body) for _ in raw_requests]

    def unavailable(self, raw_requests: Sequence[RawRequest], reason: str) -> list[Response]:
        """503 for every request: what a worker answers after its device failed."""
        body = encode_error(unavailable(f"{reason}; this worker is being replaced, retry the request"))
        return [Response(503, body, {"retry-after": "1"}) for _ in raw_requests]


def _status_headers(status: int) -> dict[str, str]:
    """What a status asks of the client: retry after a moment, or use the method allowed."""
    if status in RETRY_LATER:
        return {"retry-after": "1"}
    if status == METHOD_NOT_ALLOWED.status:
        return {"allow": ALLOWED_METHOD}
    return {}


def _since(clock: float) -> tuple[float, float]:
    """Milliseconds since `clock`, and the new clock."""
    now = time.perf_counter()
    return (now - clock) * 1000, now
