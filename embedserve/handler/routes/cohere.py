"""Cohere's and Jina's rerank: POST .../v1/rerank (Cohere v1, Jina) and .../v2/rerank (what Cohere's
ClientV2 posts), the same body and answer.

{"model", "query", "documents": [text | {"text"}], "top_n", "return_documents", "instruction",
"raw_scores", "truncate", "truncation_direction"} -> {"id", "model", "results": [{"index",
"relevance_score", "document"?}], "meta", "usage"}, best first. "instruction" only for a causal
language model reranker (its chat template's system message).
"""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any, Sequence

from embedserve.handler.api.codec import dumps, json_object, option_value, required
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, parsing
from embedserve.handler.routes.schema import (EMBED_ERRORS, ServedModel, error_responses, examples, many, operation,
                                              ref, scoring_option_schemas)
from embedserve.handler.routes.tei import best_first
from embedserve.handler.tasks.embed import IGNORED_FIELDS
from embedserve.handler.inputs.text import read_texts
from embedserve.handler.tasks.score import Scores, ScoringRequest, parse_query, scoring_options


def parse_rerank(route: Route, body: Any, content_type: str | None, method: str | None) -> ScoringRequest:
    payload = json_object(body, content_type, method)
    common = scoring_options(payload)
    query = parse_query(payload)
    for key in IGNORED_FIELDS:
        option_value(payload, key, str)
    documents = read_texts(required(payload, "documents"), "documents", objects=True)
    return ScoringRequest(route, tuple((query, text) for text in documents), "documents",
                          return_text=bool(option_value(payload, "return_documents", bool)),
                          top_n=option_value(payload, "top_n", int),
                          instruction=option_value(payload, "instruction", str), **common)


def encode_rerank(request: ScoringRequest, result: Scores, model_name: str) -> bytes:
    return cohere_answer(request.route, result.values[:, 0], request.documents, request.return_text, request.top_n,
                         model_name, result.tokens)


def cohere_answer(route: Route, relevance: Any, documents: Sequence[str], return_text: bool, top_n: int | None,
                  model_name: str, tokens: int) -> bytes:
    """Cohere's answer: the documents' scores (`relevance`, by document index), best first."""
    return dumps({
        "id": str(uuid.uuid4()),
        "model": model_name,
        "results": [{"index": i, "relevance_score": float(relevance[i]),
                     **({"document": {"text": documents[i]}} if return_text else {})}
                    for i in best_first(relevance, top_n)],
        "meta": {"api_version": {"version": "2" if route is Route.RERANK_V2 else "1"},
                 "billed_units": {"search_units": 1}},
        "usage": {"total_tokens": tokens},
    })


def cohere_operations(route: Route, model: ServedModel, parse=None) -> dict[str, Any]:
    """The rerank operation of `route`; `parse` the route's parser where it is not ROUTES_BY's."""
    example = {"query": "what is a cat", "documents": ["a small animal", "a car"], "top_n": 1}
    return {"post": operation(
        "rerankV2" if route is Route.RERANK_V2 else "rerankV1",
        "Relevance of each document to the query, Cohere's and Jina's rerank, best first",
        {"application/json": {"schema": ref("CohereRerankRequest"), "examples": examples({"documents": example})}},
        {"schema": ref("CohereRerankAnswer")},
        error_responses(EMBED_ERRORS, route, model.server, model=model, parse=parse or ROUTES_BY[route].parse))}


def schemas(model: ServedModel) -> dict[str, Any]:
    if model.task is Task.EMBED:
        return {}
    common, many_ = scoring_option_schemas(model), many(model)
    document = {"anyOf": [ref("Text"), {"type": "object", "required": ["text"], "properties": {"text": ref("Text")}}]}
    return {
        "CohereRerankRequest": {"type": "object", "required": ["query", "documents"], "properties": {
            "query": ref("Text"), "documents": {**many_, "items": document},
            "top_n": {"type": ["integer", "null"], "minimum": 1},
            "return_documents": {"type": ["boolean", "null"]},
            # Checked to be strings, then ignored, as on the embedding routes.
            **{key: {"type": ["string", "null"]} for key in IGNORED_FIELDS},
            "instruction": {"type": ["string", "null"], "maxLength": model.settings.max_input_chars,
                            "description": "the task, as the chat template's system message; missing or null: the "
                                           "model's default prompt, else its template's own"}
            if model.instructed else {"type": "null", "description": "for causal LM rerankers; refused here"},
            **common}},
        "CohereRerankAnswer": {"type": "object", "required": ["results"], "properties": {
            "id": {"type": "string"}, "model": {"type": "string"}, "meta": {"type": "object"},
            "usage": {"type": "object"},
            "results": {"type": "array", "items": {"type": "object", "required": ["index", "relevance_score"],
                                                   "properties": {"index": {"type": "integer", "minimum": 0},
                                                                  "relevance_score": {"type": "number"},
                                                                  "document": {"type": "object"}}}}}},
    }


ROUTES = tuple(RouteSpec(route, frozenset({Task.RERANK}), parsing(route, partial(parse_rerank, route)), encode_rerank,
                         partial(cohere_operations, route))
               for route in (Route.RERANK_V1, Route.RERANK_V2))
ROUTES_BY = {spec.route: spec for spec in ROUTES}
