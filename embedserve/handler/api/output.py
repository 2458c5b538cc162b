"""Answers: each request's vectors shaped as it asked, then encoded in its route's shape.

Shaping (Matryoshka dimensions, then normalization) runs on all requests of a batch together,
encoding on each alone, so a failure in either fails the answers it touches, not the batch.
Errors become bodies here too, in the shape and status of the route that asked.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Union

import torch

from embedserve.handler.api.codec import Route, encode_embeddings, encode_error
from embedserve.handler.api.errors import RequestError, internal_error, out_of_memory
from embedserve.handler.api.prepare import Job
from embedserve.handler.api.quantize import quantize
from embedserve.handler.api.scoring import ScoringRequest, encode_scores, scores
from embedserve.handler.model.files import Scoring, activation_class
from embedserve.handler.model.pooling import l2_normalize
from embedserve.handler.worker.failures import log_failure

# Statuses a client should retry after a moment: a full work budget (429 on TEI routes).
RETRY_LATER = (429, 503)

# One request's vectors and its inputs that did not fit in memory even alone, or its error.
Outcome = Union[tuple[torch.Tensor, frozenset[int]], RequestError]


def shape_vectors(jobs: dict[int, Job], outcomes: dict[int, Outcome]) -> dict[int, Outcome]:
    """Each request's vectors as it asked: Matryoshka truncation first, then normalization, so
    truncated vectors are unit length. This is also where a pipeline's final Normalize runs (the
    encoder leaves it out, model/head.py): `"normalize": false` keeps the vector before it. The
    rows of all requests that ask for one `dimensions` are normalized together, in one operation."""
    groups: dict[int | None, list[int]] = {}
    for index, job in jobs.items():
        outcome = outcomes[index]
        if isinstance(outcome, RequestError) or isinstance(job.request, ScoringRequest):
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


def answer(index: int, job: Job, outcome: Outcome, model_name: str, scoring: Scoring | None = None
           ) -> tuple[int, bytes]:
    """The status and body for request `index` of the batch, its vectors already shaped (a
    scoring model's: its logits, and `scoring` says how they become scores)."""
    if isinstance(outcome, RequestError):
        return error_body(outcome, job.request.route)
    vectors, unfit = outcome
    if unfit:
        return error_body(does_not_fit(job, min(unfit)), job.request.route)
    try:
        if isinstance(job.request, ScoringRequest):
            values = scores(vectors, _activation(scoring.activation), job.request)
            return 200, encode_scores(job.request, values, labels=scoring.labels, model_name=model_name,
                                      tokens=job.tokens)
        return 200, encode(job, vectors, model_name)
    except Exception as err:  # a bug met by one answer must not fail its batch
        log_failure(f"encoding the answer of request {index} of the batch", err)
        return error_body(internal_error("the server failed to encode this answer; the failure is logged"),
                          job.request.route)


@lru_cache(maxsize=8)
def _activation(name: str) -> torch.nn.Module:
    """A scorer's activation (a stateless torch.nn module such as Sigmoid), built once."""
    return activation_class(f"torch.nn.{name}")()


def encode(job: Job, vectors: torch.Tensor, model_name: str) -> bytes:
    """The answer to `job`, its vectors already truncated and normalized (shape_vectors)."""
    return encode_embeddings(job.request, quantize(vectors.numpy(), job.request.options.output_dtype),
                             model_name=model_name, prompt_tokens=job.tokens)


def does_not_fit(job: Job, item: int) -> RequestError:
    return out_of_memory(
        f"'{job.request.param(item)}' ({len(job.ids[item])} tokens) does not fit in memory even alone; "
        "send it shorter or lower max_length", param=job.request.param(item))


def error_body(err: RequestError, route: Route) -> tuple[int, bytes]:
    err.tei = route.tei  # TEI routes answer in TEI's shape and statuses
    return err.http_status, encode_error(err)
