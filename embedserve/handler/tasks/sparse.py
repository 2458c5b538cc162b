"""The sparse task: texts in, one sparse lexical vector per input out (SPLADE): token ids and
their weights, merged by id (the model pools them over the input's tokens), ascending by id.

Its request type and options (read off the wire by the native and TEI route families), its
answer's size bound, and its result. Preparation is the embed task's (prompt, token ids,
truncation, every limit), so a text gives the same tokens on every task.

Options, on top of the embed task's truncate, truncation_direction and prompt_name:
- `threshold`: weights below it are dropped (sentence-transformers keeps every non-zero one);
- `max_active_dims`: at most this many entries, the largest (sentence-transformers' option of
  the same name);
- `sparse_format`: "indices" gives {"indices": [...], "values": [...]}, what Qdrant and Milvus
  take as a sparse vector; "tokens" gives {"<token>": weight, ...}, what Elasticsearch's
  sparse_vector and rank_features fields take (the tokens decoded by the model's vocabulary);
- `input_type`: "query" or "document", as SparseEncoder's encode_query and encode_document: the
  prompt of that name, and on an inference-free model (a SparseStaticEmbedding query side) a
  query costs a lookup, its weight per distinct token it holds, no transformer pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from embedserve.handler.api.codec import json_type, option_value, short
from embedserve.handler.api.errors import RequestError, malformed, too_large
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.tasks.base import Job, Outcome, each_request, each_result
from embedserve.handler.tasks.embed import (CASE_INSENSITIVE, OPTION_TYPES, EmbedTask, Input, refuse_images,
                                            refuse_long_input)

SPARSE_FORMATS = ("indices", "tokens")
INPUT_TYPES = ("query", "document")

# The options of a sparse request, as OPTION_TYPES lists the embed task's: JSON type, values.
SPARSE_OPTION_TYPES: dict[str, tuple[type, tuple[str, ...]]] = {
    **{key: OPTION_TYPES[key] for key in ("truncate", "truncation_direction", "prompt_name")},
    "max_active_dims": (int, ()),  # a positive integer
    "sparse_format": (str, SPARSE_FORMATS),
    "input_type": (str, INPUT_TYPES),
}

# The most bytes one entry takes in an answer: {"index":250001,"value":-0.0000053924714}, on
# TEI's route, the largest shape; a token's own characters come on top in the "tokens" format
# (6 each at most, JSON-escaped).
_ENTRY_JSON_BYTES = 48
_ROW_OVERHEAD_BYTES = 96
_LIST_OVERHEAD_BYTES = 256


@dataclass(frozen=True)
class SparseOptions:
    truncate: bool | None = None  # None: the server's setting
    truncation_direction: str = "right"
    prompt_name: str | None = None
    threshold: float = 0.0
    max_active_dims: int | None = None
    sparse_format: str = "indices"
    input_type: str | None = None  # query, document, or neither (encode's own: a document)
    normalize: None = None  # sparse weights are never normalized (the shared preparation reads it)
    long_input: str = "truncate"  # the only way (refuse_long_input): read by the shared preparation


@dataclass(frozen=True)
class SparseRequest:
    route: Route
    inputs: tuple[Input, ...] = ()
    options: SparseOptions = field(default_factory=SparseOptions)
    field: str = "input"  # the JSON field the inputs came from, to name it in errors

    def param(self, index: int) -> str:
        return f"{self.field}[{index}]"


@dataclass(frozen=True)
class SparseVectors:
    """A sparse request's result: per input, its token ids (ascending) and weights, and the
    decoded tokens where the request asked for them."""
    ids: list[np.ndarray]  # int64, per input
    weights: list[np.ndarray]  # float32, per input
    tokens: int  # the request's tokens, for usage
    names: list[list[str]] | None = None  # each id's token, for the "tokens" format


def parse_sparse_options(payload: dict[str, Any]) -> SparseOptions:
    refuse_long_input(payload, "sparse or hybrid")
    refuse_images(payload, "sparse")
    values = {key: option_value(payload, key, kind, choices, key in CASE_INSENSITIVE)
              for key, (kind, choices) in SPARSE_OPTION_TYPES.items()}
    threshold = payload.get("threshold")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
                or threshold < 0:
            raise malformed(f"'threshold' must be a number >= 0, got {json_type(threshold)} {short(threshold)}",
                            param="threshold")
        values["threshold"] = float(threshold)
    return SparseOptions(**{key: value for key, value in values.items() if value is not None})


def sparse_answer_bytes(entries: int, rows: int, model_name: str = "") -> int:
    """An upper bound of the bytes of an answer of `rows` sparse vectors holding `entries` in all
    (tokens' own characters apart)."""
    return entries * _ENTRY_JSON_BYTES + rows * _ROW_OVERHEAD_BYTES + _LIST_OVERHEAD_BYTES + len(model_name)


def sparse_vectors(request: Any, options: SparseOptions, rows: list[np.ndarray], tokens: int,
                   token_name: Callable[[int], str], model_name: str, max_bytes: int) -> SparseVectors:
    """Each row's entries ((2, entries): ids over weights) over the threshold, the largest
    max_active_dims of them, by id; 413 where the answer would be over `max_bytes`."""
    ids, weights = [], []
    for row in rows:
        keep = row[1] >= options.threshold if options.threshold > 0 else slice(None)
        row_ids, row_weights = row[0][keep].astype(np.int64), row[1][keep]
        if options.max_active_dims is not None and len(row_ids) > options.max_active_dims:
            largest = np.sort(np.argpartition(-row_weights, options.max_active_dims - 1)[:options.max_active_dims])
            row_ids, row_weights = row_ids[largest], row_weights[largest]
        ids.append(row_ids)
        weights.append(np.ascontiguousarray(row_weights))
    names = [[token_name(i) for i in row.tolist()] for row in ids] if options.sparse_format == "tokens" else None
    entries = sum(len(row) for row in ids)
    answer = sparse_answer_bytes(entries, len(ids), model_name) + \
        (6 * sum(len(name) for row in names for name in row) if names else 0)
    if answer > max_bytes:
        raise too_large(f"'{request.field}' has {len(ids)} inputs, whose {entries} sparse entries take about "
                        f"{answer} bytes; the server sends at most max_response_bytes={max_bytes} per answer: send "
                        "fewer inputs per request, or a 'max_active_dims' or 'threshold' to keep fewer entries",
                        param=request.field)
    return SparseVectors(ids, weights, tokens, names)


class SparseTask(EmbedTask):
    """The embed task's preparation, with a sparse answer: its size bound and its result.
    `query_weights`: an inference-free model's weight per vocabulary id, for queries."""
    task = Task.SPARSE

    def __init__(self, *args: Any, query_weights: np.ndarray | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.query_weights = query_weights

    def prepare(self, requests: dict[int, Any], budget: Any) -> dict[int, Job | RequestError]:
        """Queries of an inference-free model are looked up here; the rest prepared as texts."""
        lookups = {index: request for index, request in requests.items()
                   if self.query_weights is not None and request.options.input_type == "query"}
        outcomes = super().prepare({i: r for i, r in requests.items() if i not in lookups}, budget)
        return dict(sorted({**outcomes, **each_request(lookups, self._lookup)}.items()))

    def _prompt_of(self, request: SparseRequest) -> Any:
        """A request's prompt: its prompt_name's, else its input type's where the model has one."""
        options = request.options
        return self.prompt(options.prompt_name if options.prompt_name is not None or options.input_type not in
                           self.prompts else options.input_type)

    def _lookup(self, request: SparseRequest) -> Job:
        """SparseStaticEmbedding: each query's distinct tokens (no special tokens; cut at the
        tokenizer's own limit), each weighing its id's weight; zero weights dropped."""
        self.check_limits(request)
        self._check_options(request, False)
        prefix = self._prompt_of(request).text
        limit = self.tokenizer.model_max_length if (self.tokenizer.model_max_length or 0) <= 10**6 else None
        rows, tokens = [], 0
        for ids in self.tokenizer.body_ids([prefix + text for text in request.inputs]):
            ids = np.unique(np.asarray(ids[:limit], dtype=np.int64))
            weights = self.query_weights[ids]
            kept = weights != 0
            rows.append(np.stack((ids[kept].astype(np.float32), weights[kept])).astype(np.float32))
            tokens += len(ids)
        return Job(request, [], computed=(rows, tokens))

    def _check_options(self, request: SparseRequest, normalize: bool) -> None:
        """With max_active_dims, the answer's bound is known before any work: refused here if
        over the server's largest answer; without it, once the entries are (results)."""
        dims = request.options.max_active_dims
        if dims is not None:
            bound = sparse_answer_bytes(len(request.inputs) * min(dims, self.checks.dimension), len(request.inputs),
                                        self.checks.model_name)
            self.checks.answer_size(request, bound, "send fewer inputs per request or a lower 'max_active_dims'")

    def results(self, jobs: dict[int, Job], outcomes: dict[int, Outcome]) -> dict[int, SparseVectors | RequestError]:
        return each_result(jobs, lambda index, job: self._result(job, outcomes[index][0]), "sparse")

    def _result(self, job: Job, rows: list[np.ndarray]) -> SparseVectors:
        if job.computed is not None:
            rows = job.computed[0]
        return sparse_vectors(job.request, job.request.options, rows, job.tokens, self.tokenizer.token_name,
                              self.checks.model_name, self.settings.max_response_bytes)
