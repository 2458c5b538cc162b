"""The score tasks: rerank (one label: the relevance of each (query, document) pair) and classify
(a score per label of each text or pair).

Its request type (read off the wire by the TEI and Cohere/Jina route families), its preparation
(each pair or text one model input, truncated as sentence-transformers' CrossEncoder truncates
it, or rendered through a causal reranker's chat template), its answer's size bound, and its
result: the model's logits through the activation CrossEncoder.predict applies (Sigmoid for one
label by default), or the logits themselves with "raw_scores": true; /predict on a model of
several labels answers their softmax, as TEI does (CrossEncoder.predict with apply_softmax=True).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from embedserve.handler.api.codec import json_type, option_value, required
from embedserve.handler.api.errors import RequestError, empty, internal_error, malformed, unprocessable
from embedserve.handler.api.route import Route
from embedserve.handler.inputs.text import read_text
from embedserve.handler.model.chat_pairs import ChatPairTokenizer, ChatTemplateError
from embedserve.handler.model.description import Scoring, Task
from embedserve.handler.model.head import activation_class
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.tokenization import Tokenized
from embedserve.handler.scheduling.admission import WorkBudget
from embedserve.handler.tasks.base import Job, Outcome, RequestChecks, each_request
from embedserve.handler.tasks.embed import TRUNCATION_DIRECTIONS
from embedserve.handler.worker.failures import log_failure

# One input of a scoring model: a text, or a pair of texts (query, document).
Pair = tuple[str, "str | None"]


@dataclass(frozen=True)
class ScoringRequest:
    route: Route
    inputs: tuple[Pair, ...]  # in request order: (query, document) pairs, or texts with None
    field: str  # the JSON field the documents or inputs came from, to name them in errors
    raw_scores: bool = False
    return_text: bool = False  # TEI's return_text, Cohere's and Jina's return_documents
    top_n: int | None = None
    truncate: bool | None = None  # None: the server's setting
    truncation_direction: str = "right"
    batch: bool = True  # /predict: whether the answer is one list per input
    instruction: str | None = None  # a causal reranker's task instruction; None: the model's default

    def param(self, index: int) -> str:
        """Input `index`'s place in the body, for errors."""
        return f"{self.field}[{index}]"

    @property
    def documents(self) -> list[str]:
        """The texts a rerank answer may return, by index."""
        return [second if second is not None else first for first, second in self.inputs]


@dataclass(frozen=True)
class Scores:
    """A scoring request's result: (inputs, labels) scores, float32, its tokens, the label names."""
    values: np.ndarray
    tokens: int
    labels: tuple[str, ...]


def scoring_options(payload: dict[str, Any]) -> dict[str, Any]:
    """The options every scoring route reads, as ScoringRequest's fields."""
    return dict(raw_scores=bool(option_value(payload, "raw_scores", bool)),
                truncate=option_value(payload, "truncate", bool),
                truncation_direction=option_value(payload, "truncation_direction", str, TRUNCATION_DIRECTIONS,
                                                  case_insensitive=True) or "right")


def parse_query(payload: dict[str, Any]) -> str:
    query = required(payload, "query")
    if not isinstance(query, str):
        raise malformed(f"'query' must be a string, got {json_type(query)}", param="query")
    return read_text(query, "query")


def max_scoring_answer_bytes(request: ScoringRequest, labels: int) -> int:
    """An upper bound of the answer's bytes, before scoring: documents echoed back count in
    UTF-8, JSON-escaped at worst 6 bytes a character."""
    echoed = sum(6 * len(text) for text in request.documents) if request.return_text else 0
    return scoring_answer_bytes(len(request.inputs), labels) + echoed


def scoring_answer_bytes(count: int, labels: int) -> int:
    """An upper bound of the bytes of `count` inputs' scores, no text echoed: a label's name
    and score, or an index and score, with their keys."""
    return count * (96 + 40 * labels) + 512


class ScoreTask:
    def __init__(self, checks: RequestChecks, scoring: Scoring, task: Task, *,
                 chat_pairs: ChatPairTokenizer | None = None, default_instruction: str = ""):
        """`chat_pairs`: a causal reranker's pairs rendering, `default_instruction` its default."""
        self.task = task
        self.checks = checks
        self.settings = checks.settings
        self.scoring = scoring
        self.chat_pairs = chat_pairs
        self.default_instruction = default_instruction

    @property
    def labels(self) -> tuple[str, ...]:
        return self.scoring.labels

    def prepare(self, requests: dict[int, ScoringRequest], budget: WorkBudget | None
                ) -> dict[int, Job | RequestError]:
        return each_request(requests, lambda request: self._prepare(request, budget))

    def _prepare(self, request: ScoringRequest, budget: WorkBudget | None) -> Job:
        """Each (query, document) pair, or text, as one model input; the same limits as
        embeddings, documents counting as inputs."""
        checks = self.checks
        checks.count(request)
        predict = request.route is Route.TEI_PREDICT
        for i, (first, second) in enumerate(request.inputs):
            names = ((f"inputs[{i}][0]", f"inputs[{i}][1]") if second is not None else (f"inputs[{i}]", None)) \
                if predict else ("query", request.param(i))
            for text, param in zip((first, second), names):
                if text is not None:
                    checks.text.chars(text, param)
        checks.answer_size(request, max_scoring_answer_bytes(request, len(self.labels)),
                           "send fewer inputs per request, or do not ask for the texts back")
        tokenized = self._pairs(request)
        truncate = self.settings.truncate if request.truncate is None else request.truncate
        for i, item in enumerate(tokenized):
            checks.text.length(request.param(i), item.full_length, truncate, "" if predict else " with its query")
        inputs = [ModelInput(item.ids, second=item.second) for item in tokenized]
        checks.tokens(sum(len(item) for item in inputs), request.field, budget)
        return Job(request, inputs)

    def _pairs(self, request: ScoringRequest) -> list[Tokenized]:
        """Each input tokenized as the model reads it: through a causal reranker's chat template,
        with the request's instruction or the model's default one, or as a tokenizer pair."""
        max_length = self.checks.max_length
        if self.chat_pairs is None:
            if request.instruction is not None:
                raise unprocessable("'instruction' is for causal language model rerankers, which render it through "
                                    "their chat template; this model takes none", param="instruction")
            return self.checks.tokenizer.pairs(request.inputs, max_length, request.truncation_direction)
        for i, (_, second) in enumerate(request.inputs):
            if second is None:
                raise unprocessable(f"'{request.param(i)}' is a single text; this reranker scores (query, document) "
                                    "pairs through its chat template: send [query, document]", param=request.param(i))
        instruction = self.default_instruction if request.instruction is None else request.instruction
        self.checks.text.chars(instruction, "instruction")
        try:
            return self.chat_pairs.pairs(request.inputs, max_length, request.truncation_direction, instruction)
        except ChatTemplateError as err:
            raise unprocessable(f"the model's chat template refused this request: {str(err)[:300]}",
                                param=request.field) from None

    def results(self, jobs: dict[int, Job], outcomes: dict[int, Outcome]) -> dict[int, Scores | RequestError]:
        results: dict[int, Scores | RequestError] = {}
        for index, job in jobs.items():
            logits, _ = outcomes[index]
            try:
                results[index] = Scores(self.scores(logits, job.request), job.tokens, self.labels)
            except Exception as err:  # a bug met by one answer must not fail its batch
                log_failure(f"scoring request {index} of the batch", err)
                results[index] = internal_error("the server failed to encode this answer; the failure is logged")
        return results

    def scores(self, logits: torch.Tensor, request: ScoringRequest) -> np.ndarray:
        """(inputs, labels) logits -> the scores the request asked for, float32."""
        if request.raw_scores:
            out = logits
        elif request.route is Route.TEI_PREDICT and logits.shape[1] > 1:
            out = torch.softmax(logits, dim=1)
        else:
            out = _activation(self.scoring.activation)(logits)
        return out.to(torch.float32).numpy()


@lru_cache(maxsize=8)
def _activation(name: str) -> torch.nn.Module:
    """A scorer's activation (a stateless torch.nn module such as Sigmoid), built once."""
    return activation_class(f"torch.nn.{name}")()
