"""The multi-vector task (ColBERT, a sentence-transformers MultiVectorEncoder): texts in, a vector
per token out; or a query and documents in, their MaxSim scores out.

Each input is a query, a document, or neither (`input_type`), as MultiVectorEncoder's
encode_query, encode_document and encode tell them apart:
- its prompt ("[Q] ", "[D] ": the folder's prompts of those names), tokenized with the text;
- its length: query_length, document_length, else the model's max length (max_seq_length), the
  per-type lengths applying over max_seq_length, as sentence-transformers applies them (PyLate's
  answerai-colbert-small-v1 publishes max_seq_length 299 beside document_length 300);
- a query's expansion: padded with the mask token up to the expansion length, those tokens
  attended to or not (`attend`), and returned either way;
- the skiplist (punctuation): its tokens are left out of the answer for the input types the folder
  names (documents, and inputs of no type, by default).

A folder's HierarchicalTokenPooling clusters the token vectors of the input types it names
(documents) after the skiplist, as sentence-transformers does (scipy's Ward linkage).

MaxSim: for each query token, the largest dot product with a document token, summed over the
query's tokens (in float32; "meanmaxsim" divides by their count); a document with no token
scores -1e9, as sentence-transformers scores it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from embedserve.handler.api.codec import option_value
from embedserve.handler.api.errors import RequestError, unprocessable
from embedserve.handler.api.quantize import quantize
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import ModelFilesError, MultiVector, Task, TokenPooling
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.model.pooling import l2_normalize
from embedserve.handler.scheduling.admission import WorkBudget
from embedserve.handler.tasks.base import Job, Outcome, RequestChecks, each_request, each_result
from embedserve.handler.tasks.embed import CASE_INSENSITIVE, OPTION_TYPES, max_answer_bytes, refuse_long_input

INPUT_TYPES = ("query", "document")
EMPTY_DOCUMENT_SCORE = -1e9

# The options of a multi-vector request, as OPTION_TYPES lists the embed task's; "modality":
# "image" makes the inputs (a scoring request's documents) page images, for a page retriever.
MULTI_VECTOR_OPTION_TYPES: dict[str, tuple[type, tuple[str, ...]]] = {
    **{key: OPTION_TYPES[key] for key in ("truncate", "truncation_direction", "output_dtype", "encoding_format",
                                          "modality")},
    "input_type": (str, INPUT_TYPES),
}


@dataclass(frozen=True)
class MultiVectorOptions:
    truncate: bool | None = None  # None: the server's setting
    truncation_direction: str = "right"
    output_dtype: str = "float"
    encoding_format: str = "float"
    input_type: str | None = None  # query, document, or neither (encode's own)
    modality: str = "text"  # "image": the inputs (a scoring request's documents) are page images


@dataclass(frozen=True)
class MultiVectorRequest:
    route: Route
    inputs: tuple[str, ...] = ()
    options: MultiVectorOptions = field(default_factory=MultiVectorOptions)
    field: str = "input"
    scoring: bool = False  # input 0 is a query, the others documents: answer their MaxSim scores
    return_text: bool = False  # a scoring answer echoes the documents
    top_n: int | None = None  # a scoring answer's best N (Cohere's rerank); None: every document

    def param(self, index: int) -> str:
        if self.scoring:
            return "query" if index == 0 else f"{self.field}[{index - 1}]"
        return f"{self.field}[{index}]"

    def input_type(self, index: int) -> str | None:
        if self.scoring:
            return "query" if index == 0 else "document"
        return self.options.input_type


@dataclass(frozen=True)
class TokenEmbeddings:
    """Per input, its token vectors ((tokens, dimension), in the requested dtype)."""
    vectors: list[np.ndarray]
    tokens: int


@dataclass(frozen=True)
class MaxSimScores:
    """Each document's MaxSim score against the query, by document index."""
    scores: np.ndarray  # float32, (documents,)
    tokens: int


def parse_multi_vector_options(payload: dict[str, Any]) -> MultiVectorOptions:
    refuse_long_input(payload, "multi-vector")
    values = {key: option_value(payload, key, kind, choices, key in CASE_INSENSITIVE)
              for key, (kind, choices) in MULTI_VECTOR_OPTION_TYPES.items()}
    return MultiVectorOptions(**{key: value for key, value in values.items() if value is not None})


def maxsim(query: np.ndarray, document: np.ndarray, mean: bool = False) -> np.float32:
    if not len(document):
        return np.float32(EMPTY_DOCUMENT_SCORE)
    best = (query @ document.T).max(axis=1).astype(np.float32)
    total = best.sum(dtype=np.float32)
    return np.float32(total / len(query)) if mean else total


def hierarchical_pool(row: np.ndarray, pooling: TokenPooling) -> np.ndarray:
    """HierarchicalTokenPooling's clustering of one input's token vectors: the protected ones kept,
    the others Ward-clustered on cosine distance into len // pool_factor clusters, each replaced by
    its mean (clusters in label order), then L2-normalized where the folder says so."""
    from scipy.cluster import hierarchy
    from scipy.spatial.distance import squareform

    vectors = torch.from_numpy(row)
    if pooling.pool_factor > 1:
        protected, rest = vectors[:pooling.protected], vectors[pooling.protected:]
        clusters = max(int(len(rest) // pooling.pool_factor), 1)
        if clusters < len(rest):
            distances = (1 - rest @ rest.T).clamp_(0, 2).numpy()
            linkage = hierarchy.linkage(squareform(distances, checks=False), method="ward")
            labels = torch.from_numpy(hierarchy.fcluster(linkage, t=clusters, criterion="maxclust").astype(np.int64))
            _, inverse = torch.unique(labels, return_inverse=True)
            count = int(inverse.max()) + 1
            sums = torch.zeros(count, rest.shape[1], dtype=rest.dtype).index_add_(0, inverse, rest)
            sizes = torch.bincount(inverse, minlength=count).unsqueeze(1)
            vectors = torch.cat([protected, sums / sizes])
    return (l2_normalize(vectors) if pooling.normalize else vectors).numpy()


class MultiVectorTask:
    task = Task.MULTI_VECTOR

    def __init__(self, checks: RequestChecks, model: MultiVector, prompts: dict[str, str], plain_length: int):
        self.checks = checks
        self.plain_length = plain_length  # an input of no type; checks.max_length is the longest of any type
        self.settings = checks.settings
        self.tokenizer = checks.tokenizer
        self.model = model
        self.prompts = {kind: prompts.get(kind, "") for kind in INPUT_TYPES}
        self._prompt_tokens = {kind: self.tokenizer.prompt_length(text) for kind, text in self.prompts.items()}
        self.skip_ids = np.fromiter((i for word in model.skiplist_words
                                     if (i := self.tokenizer.backend.token_to_id(word)) is not None), dtype=np.int64)
        roles = self.tokenizer.role_ids
        expansion = model.expansion
        token = expansion.token if expansion else None
        self.expansion_id = self.tokenizer.backend.token_to_id(token) if token else roles.get("mask", roles.get("eos"))
        if model.token_pooling is not None and importlib.util.find_spec("scipy") is None:
            raise ModelFilesError("the model's HierarchicalTokenPooling clusters with scipy, which is not installed "
                                  "(pip install scipy)")

    def max_length(self, input_type: str | None) -> int:
        """Tokens an input of this type keeps (special and prompt tokens included)."""
        model, limit, plain = self.model, self.checks.max_length, self.plain_length
        if input_type == "document":
            return min(model.document_length or plain, limit)
        if input_type == "query":
            expansion = model.expansion
            if expansion and expansion.strategy == "fixed":
                return min(expansion.length, limit)
            length = model.query_length or plain
            return min(max(length, expansion.length) if expansion and model.query_length else length, limit)
        return plain

    def prepare(self, requests: dict[int, MultiVectorRequest], budget: WorkBudget | None
                ) -> dict[int, Job | RequestError]:
        return each_request(requests, lambda request: self._job(request, budget))

    def _job(self, request: MultiVectorRequest, budget: WorkBudget | None) -> Job:
        if request.options.modality != "text":
            raise unprocessable("'modality' image: page images need a page retriever (ColPali); this multi-vector "
                                "model reads texts only", param="modality")
        self.checks.count(request)
        for i, text in enumerate(request.inputs):
            self.checks.text.chars(text, request.param(i))
        if not request.scoring:
            self._check_answer(request)
        options = request.options
        truncate = self.settings.truncate if options.truncate is None else options.truncate
        kinds = [request.input_type(i) for i in range(len(request.inputs))]
        bodies = self.tokenizer.body_ids([self.prompts.get(kind or "", "") + text
                                          for kind, text in zip(kinds, request.inputs)])
        inputs = []
        for i, (kind, body) in enumerate(zip(kinds, bodies)):
            keep = self._prompt_tokens.get(kind or "", 0)
            item = self.tokenizer.assemble(body, self.max_length(kind), options.truncation_direction, keep=keep)
            self.checks.text.length(request.param(i), item.full_length, truncate)
            inputs.append(self._expanded(list(item.ids)) if kind == "query" else ModelInput(item.ids))
        self.checks.tokens(sum(len(item) for item in inputs), request.field, budget)
        return Job(request, inputs)

    def _expanded(self, ids: list[int]) -> ModelInput:
        """A query padded with the expansion token up to the expansion length."""
        expansion = self.model.expansion
        if expansion is None or self.expansion_id is None or len(ids) >= expansion.length:
            return ModelInput(ids)
        added = expansion.length - len(ids)
        return ModelInput(ids + [self.expansion_id] * added, expansion=0 if expansion.attend else added)

    def _check_answer(self, request: MultiVectorRequest, tokens: int | None = None) -> None:
        """The answer's bound before the model's work: a vector for each of `tokens` positions, by
        default every input at its type's full length."""
        options = request.options
        if tokens is None:
            tokens = len(request.inputs) * self.max_length(options.input_type)
        answer = max_answer_bytes(tokens, self.checks.dimension, options.output_dtype, options.encoding_format,
                                  self.checks.model_name, request.route)
        self.checks.answer_size(request, answer, "send fewer inputs per request, \"encoding_format\": \"base64\" or "
                                                 "a smaller 'output_dtype'")

    def results(self, jobs: dict[int, Job], outcomes: dict[int, Outcome]) -> dict[int, Any]:
        return each_result(jobs, lambda index, job: self._result(job, outcomes[index][0]), "multi-vector")

    def _result(self, job: Job, outputs: list[np.ndarray]) -> TokenEmbeddings | MaxSimScores:
        rows = [self._kept(job, i, row) for i, row in enumerate(outputs)]
        return self._scores(job, rows) if job.request.scoring else \
            TokenEmbeddings([quantize(row, job.request.options.output_dtype) for row in rows], job.tokens)

    def _kept(self, job: Job, index: int, row: np.ndarray) -> np.ndarray:
        """The input's token vectors less its skiplist tokens, where its type has a skiplist, then
        pooled, where its type is pooled."""
        kind = job.request.input_type(index) or "document"
        if kind in self.model.skiplist_tasks and len(self.skip_ids):
            row = row[~np.isin(np.asarray(job.inputs[index].ids, dtype=np.int64), self.skip_ids)]
        pooling = self.model.token_pooling
        return hierarchical_pool(row, pooling) if pooling and kind in pooling.tasks else row

    def _scores(self, job: Job, rows: list[np.ndarray]) -> MaxSimScores:
        mean = self.model.similarity == "meanmaxsim"
        return MaxSimScores(np.array([maxsim(rows[0], document, mean) for document in rows[1:]], dtype=np.float32),
                            job.tokens)

