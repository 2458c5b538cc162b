"""The scoring routes of a reranker or classifier: one raw request in, a ScoringRequest out;
scores in, wire bytes out. Plain Python + numpy, like codec.py.

  "rerank"     TEI: {"query", "texts", "raw_scores", "return_text", "truncate",
               "truncation_direction"} -> [{"index", "score", "text"?}], best first
  "v1/rerank"  Cohere v1 / Jina: {"model", "query", "documents": [str | {"text"}], "top_n",
               "return_documents", "instruction"} -> {"id", "model", "results": [{"index",
               "relevance_score", "document"?}], "meta", "usage"}, best first; "instruction"
               only for a causal language model reranker (its chat template's system message)
  "v2/rerank"  Cohere v2 (what its ClientV2 posts): the same body and answer
  "predict"    TEI: {"inputs": str | [str, str] | [str | [str, str], ...], "raw_scores",
               "truncate", "truncation_direction"} -> [{"score", "label"}] per input, best first
               (one list for a single input, a list of lists for a batch)

Scores are the model's logits through the activation sentence-transformers' CrossEncoder
applies (`CrossEncoder.predict`: Sigmoid for one label by default), or the logits themselves
with "raw_scores": true. /predict on a model of several labels answers their softmax, as TEI
does (CrossEncoder.predict with apply_softmax=True).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embedserve.handler.api.codec import (IGNORED_FIELDS, TRUNCATION_DIRECTIONS, Route, check_method, check_text,
                                          decode_body, dumps, json_type, option_value)
from embedserve.handler.api.errors import RequestError, empty, malformed

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


def parse_scoring(body: Any, content_type: str | None, route: Route, method: str | None = None) -> ScoringRequest:
    """Decode and validate one scoring request; raise RequestError naming the faulty field."""
    try:
        check_method(method, body, content_type)
        payload = decode_body(body, content_type)
        if not isinstance(payload, dict):
            raise malformed("request body must be a JSON object", param="body")
        common = dict(raw_scores=bool(option_value(payload, "raw_scores", bool, ())),
                      truncate=option_value(payload, "truncate", bool, ()),
                      truncation_direction=option_value(payload, "truncation_direction", str,
                                                        TRUNCATION_DIRECTIONS) or "right")
        if route is Route.TEI_PREDICT:
            inputs, batch = _predict_inputs(_required(payload, "inputs"))
            return ScoringRequest(route, inputs, "inputs", batch=batch, **common)
        query = _required(payload, "query")
        if not isinstance(query, str):
            raise malformed(f"'query' must be a string, got {json_type(query)}", param="query")
        check_text(query, "query")
        if route is Route.TEI_RERANK:
            texts = _texts(_required(payload, "texts"), "texts")
            return ScoringRequest(route, tuple((query, text) for text in texts), "texts",
                                  return_text=bool(option_value(payload, "return_text", bool, ())), **common)
        for key in IGNORED_FIELDS:
            option_value(payload, key, str, ())
        documents = _texts(_required(payload, "documents"), "documents", objects=True)
        return ScoringRequest(route, tuple((query, text) for text in documents), "documents",
                              return_text=bool(option_value(payload, "return_documents", bool, ())),
                              top_n=option_value(payload, "top_n", int, ()),
                              instruction=option_value(payload, "instruction", str, ()), **common)
    except RequestError as err:
        err.tei = route.tei
        raise


def _required(payload: dict[str, Any], key: str) -> Any:
    if payload.get(key) is None:
        raise malformed(f"missing required field '{key}'", param=key)
    return payload[key]


def _texts(value: Any, name: str, objects: bool = False) -> list[str]:
    """A non-empty list of texts; with `objects`, {"text": ...} items too (Cohere, Jina)."""
    if not isinstance(value, list):
        raise malformed(f"'{name}' must be a list of strings, got {json_type(value)}", param=name)
    if not value:
        raise empty(f"'{name}' must not be an empty list", param=name)
    texts = []
    for i, item in enumerate(value):
        param = f"{name}[{i}]"
        if objects and isinstance(item, dict):
            item, param = item.get("text"), f"{param}.text"
        if not isinstance(item, str):
            kind = "a string or an object with a 'text' string" if objects else "a string"
            raise malformed(f"'{param}' must be {kind}, got {json_type(item)}", param=param)
        texts.append(check_text(item, param))
    return texts


def _predict_inputs(value: Any) -> tuple[tuple[Pair, ...], bool]:
    """TEI's forms: a text; a pair [a, b]; a batch of texts and pairs. The answer is one list for
    the first two, a list per input for a batch."""
    if isinstance(value, str):
        return ((check_text(value, "inputs"), None),), False
    if not isinstance(value, list) or not value:
        raise (empty if isinstance(value, list) else malformed)(
            f"'inputs' must be a text, a pair [text, text], or a non-empty list of them, got {json_type(value)}",
            param="inputs")
    if len(value) == 2 and all(isinstance(item, str) for item in value):
        return ((check_text(value[0], "inputs[0]"), check_text(value[1], "inputs[1]")),), False
    inputs: list[Pair] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            inputs.append((check_text(item, f"inputs[{i}]"), None))
        elif isinstance(item, list) and len(item) == 2 and all(isinstance(text, str) for text in item):
            inputs.append((check_text(item[0], f"inputs[{i}][0]"), check_text(item[1], f"inputs[{i}][1]")))
        else:
            raise malformed(f"'inputs[{i}]' must be a text or a pair [text, text], got {json_type(item)}"
                            f"{f' of {len(item)} items' if isinstance(item, list) else ''}", param=f"inputs[{i}]")
    return tuple(inputs), True


# --- answers -----------------------------------------------------------------------------------

def scores(logits: torch.Tensor, activation: torch.nn.Module, request: ScoringRequest) -> np.ndarray:
    """(inputs, labels) logits -> the scores the request asked for, float32."""
    if request.raw_scores:
        out = logits
    elif request.route is Route.TEI_PREDICT and logits.shape[1] > 1:
        out = torch.softmax(logits, dim=1)
    else:
        out = activation(logits)
    return out.to(torch.float32).numpy()


def encode_scores(request: ScoringRequest, values: np.ndarray, *, labels: tuple[str, ...], model_name: str,
                  tokens: int) -> bytes:
    """(inputs, labels) scores in the route's shape."""
    if request.route is Route.TEI_PREDICT:
        per_input = [sorted(({"score": float(score), "label": label} for label, score in zip(labels, row)),
                            key=lambda item: -item["score"]) for row in values]
        return dumps(per_input if request.batch else per_input[0])
    relevance = values[:, 0]
    order = sorted(range(len(relevance)), key=lambda i: (-float(relevance[i]), i))
    if request.top_n is not None:
        order = order[:request.top_n]
    documents = request.documents
    if request.route is Route.TEI_RERANK:
        return dumps([{"index": i, "score": float(relevance[i]),
                       **({"text": documents[i]} if request.return_text else {})} for i in order])
    return dumps({
        "id": str(uuid.uuid4()),
        "model": model_name,
        "results": [{"index": i, "relevance_score": float(relevance[i]),
                     **({"document": {"text": documents[i]}} if request.return_text else {})} for i in order],
        "meta": {"api_version": {"version": "2" if request.route is Route.RERANK_V2 else "1"},
                 "billed_units": {"search_units": 1}},
        "usage": {"total_tokens": tokens},
    })


def max_scoring_answer_bytes(request: ScoringRequest, labels: int) -> int:
    """An upper bound of the answer's bytes, before scoring: documents echoed back count in
    UTF-8, JSON-escaped at worst 6 bytes a character."""
    echoed = sum(6 * len(text) for text in request.documents) if request.return_text else 0
    return scoring_answer_bytes(len(request.inputs), labels) + echoed


def scoring_answer_bytes(count: int, labels: int) -> int:
    """An upper bound of the bytes of `count` inputs' scores, no text echoed: a label's name
    and score, or an index and score, with their keys."""
    return count * (96 + 40 * labels) + 512
