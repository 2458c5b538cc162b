"""A batch's jobs embedded together, each failure traced to the requests that cause it.

A forward pass that raises is retried on halves of the batch's requests until the request that
causes it is found (500 for it, vectors for the rest); a vector that is not finite fails its
request (and was not cached). A device failure ends the batch: the worker is replaced. Through a
cache, the encoder's outputs are cut into a row per input and put back together by the cache's
row codec, whatever kind of row the model gives (dense, sparse, token vectors, bge-m3's three).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from embedserve.handler.api.errors import internal_error
from embedserve.handler.execution.device_errors import DeviceFailure
from embedserve.handler.execution.encoder import Encoder, finite_rows
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.scheduling.cache import EmbeddingCache, embed_cached
from embedserve.handler.scheduling.planner import flatten
from embedserve.handler.tasks.base import Job, Outcome
from embedserve.handler.worker.failures import log_failure
from embedserve.handler.worker.metrics import BatchReport

log = logging.getLogger(__name__)


def embed_isolated(encoder: Encoder, cache: EmbeddingCache | None, jobs: list[tuple[int, Job]],
                   report: BatchReport) -> dict[int, Outcome]:
    """Each request's vectors (a scoring model's logits) and its inputs that did not fit in
    memory, or its error."""
    inputs, spans = flatten([job.inputs for _, job in jobs])
    try:
        # No input (an inference-free model's queries alone, looked up): nothing to cache.
        vectors, unfit = _embed(encoder, inputs, report) if cache is None or not inputs else \
            _embed_cached(encoder, cache, inputs, report)
    except DeviceFailure:
        raise
    except Exception as err:
        if len(jobs) > 1:
            half = len(jobs) // 2
            return {**embed_isolated(encoder, cache, jobs[:half], report),
                    **embed_isolated(encoder, cache, jobs[half:], report)}
        [(index, job)] = jobs
        log_failure(f"embedding request {index} of the batch", err)
        return {index: internal_error("the server failed to embed this request; the failure is logged")}
    finite = finite_rows(vectors)
    every_row_finite = all(finite)  # nearly always: then no request's rows need a look
    outcomes: dict[int, Outcome] = {}
    for (index, job), span in zip(jobs, spans):
        own_unfit = frozenset(i - span.start for i in unfit if span.start <= i < span.stop) if unfit else frozenset()
        broken = [] if every_row_finite else \
            [i for i in range(span.stop - span.start) if not finite[span.start + i] and i not in own_unfit]
        if broken:
            log.error("request %d of the batch: the model gave a non-finite vector for its input %d", index, broken[0])
            param = job.request.param(broken[0])
            outcomes[index] = internal_error(f"the model gave a non-finite vector for '{param}', which is never "
                                             "served; the failure is logged", param=param)
        else:
            outcomes[index] = (vectors[span], own_unfit)
    return outcomes


def _embed(encoder: Encoder, inputs: list[ModelInput], report: BatchReport
           ) -> tuple[torch.Tensor | list, frozenset[int]]:
    """Vectors (a scoring model's logits; a sparse model's entries) in input order, and the inputs that did not fit in
    memory even alone."""
    embedded = encoder.embed(inputs)
    report.forward_passes += embedded.passes
    report.real_tokens += embedded.real_tokens
    report.padded_tokens += embedded.padded_tokens
    report.cpu_threads = max(report.cpu_threads, embedded.cpu_threads)
    return embedded.vectors, embedded.too_large


def _embed_cached(encoder: Encoder, cache: EmbeddingCache, inputs: list[ModelInput], report: BatchReport
                  ) -> tuple[Any, frozenset[int]]:
    """As `_embed`, through the cache: the outputs in the encoder's own shape."""
    def embed(missing: list[ModelInput]) -> tuple[list, frozenset[int]]:
        vectors, unfit = _embed(encoder, missing, report)
        return cache.codec.split(vectors), unfit

    rows, unfit = embed_cached(cache, inputs, embed, report)
    return cache.codec.join(rows), unfit
