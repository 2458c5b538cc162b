"""The service: a batch of raw requests in, one response per request out.

Server-agnostic: the server's adapter (embedserve/handler/torchserve/) only moves bytes and
statuses in and out. A request's path: its route family parses it (routes/) -> the model's task
slice prepares it, one ModelInput per input (tasks/) -> the batch's work budget admits it
(scheduling/admission.py) -> the encoder embeds the inputs of all admitted requests together,
through the cache where there is one -> the task slice makes each result -> the route family
encodes it. A fault of one request is its own error response at every stage; `handle` never
raises for one request. assembly.py builds the service and its parts, in one step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from embedserve.handler.api.codec import encode_error
from embedserve.handler.api.errors import RequestError, internal_error, overloaded
from embedserve.handler.api.exchange import JSON, RawRequest, Response
from embedserve.handler.execution.encoder import Encoder
from embedserve.handler.execution.isolated import embed_isolated
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import error_body
from embedserve.handler.routes.describe import Description
from embedserve.handler.routes.table import find, spec_for, task_routes
from embedserve.handler.scheduling.admission import WorkBudget, admit, max_request_tokens
from embedserve.handler.scheduling.cache import EmbeddingCache
from embedserve.handler.settings import Settings
from embedserve.handler.tasks.base import Job, TaskSlice, does_not_fit
from embedserve.handler.tasks.embed import EmbedTask
from embedserve.handler.worker.failures import log_failure
from embedserve.handler.worker.metrics import BatchReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddingService:
    work: TaskSlice  # the model's task: what its requests ask of it
    text: EmbedTask  # the text preparation every model has (prompts, token ids, /tokenize)
    encoder: Encoder
    settings: Settings
    model_name: str
    cache: EmbeddingCache | None
    description: Description  # info, openapi.json, docs, tokenize
    tokens_per_second: float | None = None  # measured at warm-up
    budget: WorkBudget | None = None  # each batch's work; None without a measured speed

    @property
    def task(self) -> Task:
        return self.work.task

    @property
    def routes(self) -> tuple:
        """The routes of this model's task (besides info, tokenize, openapi.json and docs)."""
        return task_routes(self.task)

    @property
    def max_request_tokens(self) -> int:
        return max_request_tokens(self.settings.max_tokens_per_request, self.budget)

    @property
    def batch_work_tokens(self) -> int | None:
        return self.budget.tokens if self.budget else None

    def info(self) -> dict[str, Any]:
        return self.description.info(self)

    def openapi(self) -> dict[str, Any]:
        return self.description.openapi(self)

    def handle(self, raw_requests: Sequence[RawRequest]) -> list[Response]:
        return self.handle_with_report(raw_requests)[0]

    def handle_with_report(self, raw_requests: Sequence[RawRequest]) -> tuple[list[Response], BatchReport]:
        report = BatchReport(requests=len(raw_requests), cache_enabled=self.cache is not None, task=self.task)
        clock = time.perf_counter()
        answers: list[tuple[int, bytes, str] | None] = [None] * len(raw_requests)
        requests: dict[int, Any] = {}
        for index, raw in enumerate(raw_requests):
            request = None
            try:
                spec, rest = find(raw.url_path, self.task)
                request = spec.parse(raw.body, raw.content_type, raw.method)
                if spec.encode is None:
                    answers[index] = self.description.answer(self, spec.route, request, rest)
                else:
                    requests[index] = request
            except Exception as err:
                if not isinstance(err, RequestError):  # a bug met by one request must not fail its batch
                    log_failure(f"preparing request {index} of the batch", err)
                    err = internal_error()
                # In the shape of its route; a parse error already is (a TEI body on the native route is TEI's).
                answers[index] = (*error_body(err, request.route), JSON) if request is not None else \
                    (err.http_status, encode_error(err), JSON)
        report.parse_ms, clock = _since(clock)
        jobs: dict[int, Job] = {}
        for index, outcome in self.work.prepare(requests, self.budget).items():
            if isinstance(outcome, RequestError):
                answers[index] = (*error_body(outcome, requests[index].route), JSON)
            else:
                jobs[index] = outcome
        report.tokenize_ms, clock = _since(clock)

        jobs = self._admit(jobs, answers)
        if jobs:
            outcomes = embed_isolated(self.encoder, self.cache, list(jobs.items()), report)
            report.model_ms, clock = _since(clock)
            for index, body in self._answer(jobs, outcomes).items():
                answers[index] = (*body, JSON)
            report.encode_ms, clock = _since(clock)
            report.inputs = sum(len(job.inputs) for job in jobs.values())

        for status, _, _ in answers:
            report.statuses[status] = report.statuses.get(status, 0) + 1
        log.debug("batch: %s", report)  # counts only: request text never reaches the logs
        headers = {"x-batch-size": str(len(raw_requests)), "server-timing": report.server_timing()}
        return [Response.of(status, body, content_type, **headers)
                for status, body, content_type in answers], report

    def _admit(self, jobs: dict[int, Job], answers: list) -> dict[int, Job]:
        """The requests this batch's work budget holds, in arrival order; the others are answered
        503 with retry-after: they would have pushed the batch past the response timeout."""
        admission = admit({index: job.tokens for index, job in jobs.items()}, self.budget)
        for index, held in admission.refused.items():
            answers[index] = (*error_body(overloaded(
                f"this worker's batch already holds {held} of the {self.budget.tokens} tokens it may embed "
                "within the response timeout; retry the request"), jobs[index].request.route), JSON)
        return {index: jobs[index] for index in admission.admitted}

    def _answer(self, jobs: dict[int, Job], outcomes: dict) -> dict[int, tuple[int, bytes]]:
        """Each request's status and body: its error, or its result encoded by its route."""
        bodies: dict[int, tuple[int, bytes]] = {}
        done: dict[int, Job] = {}
        for index, job in jobs.items():
            outcome = outcomes[index]
            if isinstance(outcome, RequestError):
                bodies[index] = error_body(outcome, job.request.route)
            elif outcome[1]:  # an input that did not fit in memory even alone
                bodies[index] = error_body(does_not_fit(job, min(outcome[1])), job.request.route)
            else:
                done[index] = job
        for index, result in self.work.results(done, outcomes).items():
            route = done[index].request.route
            try:
                bodies[index] = error_body(result, route) if isinstance(result, RequestError) else \
                    (200, spec_for(route, self.task).encode(done[index].request, result, self.model_name))
            except Exception as err:  # a bug met by one answer must not fail its batch
                log_failure(f"encoding the answer of request {index} of the batch", err)
                bodies[index] = error_body(internal_error("the server failed to encode this answer; the failure "
                                                          "is logged"), route)
        return bodies


def _since(clock: float) -> tuple[float, float]:
    """Milliseconds since `clock`, and the new clock."""
    now = time.perf_counter()
    return (now - clock) * 1000, now
