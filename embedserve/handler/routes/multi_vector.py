"""A multi-vector (ColBERT) model's routes.

  ""           {"input": text | [text, ...], "input_type": "query" | "document", "truncate",
               "truncation_direction", "output_dtype", "encoding_format"} or a text/plain body ->
               OpenAI's list shape, each "embedding" the input's token vectors: [[float, ...], ...]
               (tokens x dimension), or base64 of them row by row
  "v1/embeddings" OpenAI's: the native route's JSON body and answer, for OpenAI clients; base64
               (what the official client asks for unasked) is the token vectors row by row, which
               that client decodes into one flat list: reshape it to (-1, dimension)
  "embed_all"  TEI's: {"inputs", "truncate", "truncation_direction"} and "input_type" ->
               [[[float, ...], ...], ...], each text's token vectors
  "rerank"     TEI's: {"query", "texts", "return_text", "truncate", "truncation_direction"} ->
               [{"index", "score", "text"?}], MaxSim scores, best first
  "v1/rerank", "v2/rerank"  Cohere's and Jina's (routes/cohere.py's body and answer), MaxSim scores as
               relevance_score; "instruction" refused (a cross-encoder's or causal reranker's option)

The options are the multi-vector task's (tasks/multi_vector.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from embedserve.handler.api.codec import dumps, json_object, option_value, required
from embedserve.handler.api.errors import RequestError, malformed
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, parsing, texts_body
from embedserve.handler.routes.cohere import cohere_answer, cohere_operations
from embedserve.handler.routes.openai import encode_vector, openai_list
from embedserve.handler.routes.schema import (EMBED_ERRORS, ServedModel, error_responses, examples, many,
                                              most_images, operation, option_schema, ref)
from embedserve.handler.routes.tei import best_first
from embedserve.handler.tasks.embed import IGNORED_FIELDS
from embedserve.handler.tasks.multi_vector import (INPUT_TYPES, MaxSimScores, MultiVectorRequest, TokenEmbeddings,
                                                   parse_multi_vector_options)
from embedserve.handler.inputs.text import read_texts
from embedserve.handler.tasks.score import parse_query

MULTI_VECTOR = frozenset({Task.MULTI_VECTOR})
# TEI's rerank options: "modality": "image" makes its texts page images (a page retriever).
SCORING_OPTIONS = ("truncate", "truncation_direction", "modality")


def parse(route: Route, body: Any, content_type: str | None, method: str | None) -> MultiVectorRequest:
    """Texts to embed token by token: a text/plain body (the native route), or a JSON object with
    them under `input` (`inputs` on TEI's route) and the options; errors in the route's shape."""
    try:
        payload, texts, name = texts_body(route, body, content_type, method)
        if payload.get("prompt_name") is not None:
            raise malformed("'prompt_name' does not apply to a multi-vector model: send \"input_type\": \"query\" or "
                            "\"document\" (each has the model's own prompt)", param="prompt_name")
        return MultiVectorRequest(route, texts, parse_multi_vector_options(payload), field=name)
    except RequestError as err:
        err.tei = route.tei
        raise


def parse_rerank(body: Any, content_type: str | None, method: str | None) -> MultiVectorRequest:
    try:
        payload = json_object(body, content_type, method)
        options = parse_multi_vector_options({key: payload.get(key) for key in SCORING_OPTIONS})
        option_value(payload, "raw_scores", bool)  # MaxSim has no activation: its scores are raw
        texts = read_texts(required(payload, "texts"), "texts")
        return MultiVectorRequest(Route.TEI_RERANK, (parse_query(payload), *texts), options, field="texts",
                                  scoring=True, return_text=bool(option_value(payload, "return_text", bool)))
    except RequestError as err:
        err.tei = True
        raise


def parse_cohere_rerank(route: Route, body: Any, content_type: str | None, method: str | None
                        ) -> MultiVectorRequest:
    payload = json_object(body, content_type, method)
    for key in IGNORED_FIELDS:
        option_value(payload, key, str)
    if payload.get("instruction") is not None:
        raise malformed("'instruction' applies to causal language model rerankers; a multi-vector model scores by "
                        "MaxSim over its query and document prompts", param="instruction")
    options = parse_multi_vector_options({key: payload.get(key) for key in ("truncate", "truncation_direction")})
    option_value(payload, "raw_scores", bool)  # MaxSim has no activation: its scores are raw
    documents = read_texts(required(payload, "documents"), "documents", objects=True)
    return MultiVectorRequest(route, (parse_query(payload), *documents), options, field="documents", scoring=True,
                              return_text=bool(option_value(payload, "return_documents", bool)),
                              top_n=option_value(payload, "top_n", int))


def encode_cohere_rerank(request: MultiVectorRequest, result: MaxSimScores, model_name: str) -> bytes:
    return cohere_answer(request.route, result.scores, request.inputs[1:], request.return_text, request.top_n,
                         model_name, result.tokens)


def encode_list(request: MultiVectorRequest, result: TokenEmbeddings, model_name: str) -> bytes:
    return openai_list([{"object": "embedding", "index": i, "embedding": encode_vector(rows, request)}
                        for i, rows in enumerate(result.vectors)], model_name, result.tokens)


def encode_all(request: MultiVectorRequest, result: TokenEmbeddings, model_name: str) -> bytes:
    return dumps([encode_vector(rows, request) for rows in result.vectors])


def encode_rerank(request: MultiVectorRequest, result: MaxSimScores, model_name: str) -> bytes:
    documents = request.inputs[1:]
    return dumps([{"index": i, "score": float(result.scores[i]), **({"text": documents[i]} if request.return_text
                                                                      else {})}
                  for i in best_first(result.scores, None)])


# --- the OpenAPI document --------------------------------------------------------------------------

def _options(model: ServedModel) -> dict[str, Any]:
    shared = {key: option_schema(key, model) for key in ("truncate", "truncation_direction", "output_dtype",
                                                           "encoding_format")}
    return {**shared, "modality": option_schema("modality", model),
            "input_type": {"enum": [*INPUT_TYPES, None], "description": "query or document: its prompt, "
                           "length, query expansion and skiplist; missing: neither (encode's own)"}}


def _page_list(model: ServedModel) -> dict[str, Any]:
    return {**many(model), "maxItems": most_images(model), "items": ref("Image")}


def _pages_are_images(model: ServedModel, field: str, listed: bool = False) -> dict[str, Any]:
    """A page retriever's request with "modality": "image": `field` holds page images (`listed`: a
    list of them, never one alone)."""
    if not model.reads_images:
        return {}
    then = {"properties": {field: _page_list(model) if listed else ref("ImageInputs")}}
    if listed:  # a scoring request: its query is a text, its documents the images
        return {"if": {"required": ["modality"], "properties": {"modality": {"const": "image"}}}, "then": then}
    # Texts are queries: "document" is for page images alone.
    return {"if": {"required": ["modality"], "properties": {"modality": {"const": "image"}}}, "then": then,
            "else": {"properties": {"input_type": {"enum": ["query", None]}}}}


def schemas(model: ServedModel) -> dict[str, Any]:
    if model.task is not Task.MULTI_VECTOR:
        return {}
    tokens = {"anyOf": [{"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                        {"type": "string", "contentEncoding": "base64"}],
              "description": "the input's token vectors, tokens x dimension (base64: row by row)"}
    return {
        "MultiVectorRequest": {"type": "object", "required": ["input"],
                               "properties": {"input": {"anyOf": [ref("Text"), {**many(model), "items": ref("Text")},
                                                                  *([ref("ImageInputs")] if model.reads_images else [])]},
                                              **_options(model),
                                              **{key: {"type": ["string", "null"]} for key in IGNORED_FIELDS}},
                               **_pages_are_images(model, "input")},
        "MultiVectorList": {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
            "object": {"const": "list"}, "model": {"const": model.name}, "usage": {"type": "object"},
            "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                                "properties": {"object": {"const": "embedding"},
                                                               "index": {"type": "integer"}, "embedding": tokens}}}}},
        "TEIEmbedAllRequest": {"type": "object", "required": ["inputs"],
                               "properties": {"inputs": ref("TEIInputs"), **_options(model)}},
        "TEIEmbedAll": {"type": "array", "items": tokens},
        "MaxSimRerankRequest": {"type": "object", "required": ["query", "texts"], "properties": {
            "query": ref("Text"), "texts": {"anyOf": [{**many(model), "items": ref("Text")},
                                                      *([_page_list(model)] if model.reads_images else [])]},
            "return_text": {"type": ["boolean", "null"]}, "raw_scores": {"type": ["boolean", "null"]},
            **{key: option_schema(key, model) for key in SCORING_OPTIONS}}, **_pages_are_images(model, "texts", listed=True)},
        "MaxSimRanking": {"type": "array", "items": {"type": "object", "required": ["index", "score"], "properties": {
            "index": {"type": "integer"}, "score": {"type": "number"}, "text": {"type": "string"}}}},
    }


def _native(model: ServedModel) -> dict[str, Any]:
    return {"post": operation(
        "embed_tokens", "Token vectors (ColBERT): per input, a vector per token",
        {"application/json": {"schema": ref("MultiVectorRequest"),
                              "examples": examples({"query": {"input": "what is a cat", "input_type": "query"},
                                                    "documents": {"input": ["a cat is a small animal"],
                                                                  "input_type": "document"}})},
         "text/plain": {"schema": ref("Text"), "example": "hello world"}},
        {"schema": ref("MultiVectorList")},
        error_responses(EMBED_ERRORS, Route.NATIVE, model.server, model=model, parse=partial(parse, Route.NATIVE)))}


def _openai(model: ServedModel) -> dict[str, Any]:
    return {"post": operation(
        "createTokenEmbeddings", "Token vectors (ColBERT) in OpenAI's list: per input, a vector per token",
        {"application/json": {"schema": ref("MultiVectorRequest"),
                              "example": {"input": ["what is a cat"], "input_type": "query", "model": model.name,
                                          "encoding_format": "float"}}},
        {"schema": ref("MultiVectorList")},
        error_responses(EMBED_ERRORS, Route.OPENAI, model.server, model=model, parse=partial(parse, Route.OPENAI)))}


def _embed_all(model: ServedModel) -> dict[str, Any]:
    return {"post": operation(
        "embed_all", "TEI's /embed_all: each text's token vectors",
        {"application/json": {"schema": ref("TEIEmbedAllRequest"), "example": {"inputs": ["hello world"]}}},
        {"schema": ref("TEIEmbedAll")},
        error_responses(EMBED_ERRORS, Route.TEI_EMBED_ALL, model.server, model=model,
                        parse=partial(parse, Route.TEI_EMBED_ALL)))}


def _rerank(model: ServedModel) -> dict[str, Any]:
    return {"post": operation(
        "rerank_maxsim", "TEI's /rerank, scored by MaxSim over the query's and each text's token vectors",
        {"application/json": {"schema": ref("MaxSimRerankRequest"),
                              "example": {"query": "what is a cat", "texts": ["a small animal", "a car"]}}},
        {"schema": ref("MaxSimRanking")},
        error_responses(EMBED_ERRORS, Route.TEI_RERANK, model.server))}


_COHERE_PARSE = {route: parsing(route, partial(parse_cohere_rerank, route)) for route in (Route.RERANK_V1,
                                                                                          Route.RERANK_V2)}
ROUTES = (
    RouteSpec(Route.NATIVE, MULTI_VECTOR, partial(parse, Route.NATIVE), encode_list, _native),
    RouteSpec(Route.OPENAI, MULTI_VECTOR, partial(parse, Route.OPENAI), encode_list, _openai),
    RouteSpec(Route.TEI_EMBED_ALL, MULTI_VECTOR, partial(parse, Route.TEI_EMBED_ALL), encode_all, _embed_all),
    RouteSpec(Route.TEI_RERANK, MULTI_VECTOR, parse_rerank, encode_rerank, _rerank),
    *(RouteSpec(route, MULTI_VECTOR, parse, encode_cohere_rerank, partial(cohere_operations, route, parse=parse))
      for route, parse in _COHERE_PARSE.items()),
)
