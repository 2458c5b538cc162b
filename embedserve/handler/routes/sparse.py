"""A sparse (SPLADE) model's routes: the native route, and TEI's /embed_sparse in TEI's shape.

  ""              {"input": text | [text, ...], options} or a text/plain body ->
                  {"object": "list", "data": [{"object": "sparse_embedding", "index", "embedding"}], "model",
                  "usage"}; "embedding" is {"indices": [...], "values": [...]} (Qdrant's and Milvus's
                  sparse vector), or {"<token>": weight} with "sparse_format": "tokens" (Elasticsearch's
                  sparse_vector)
  "v1/embeddings" OpenAI's: the native route's JSON body and answer, for OpenAI clients (the official
                  one sends "encoding_format": "base64" unasked: checked, and moot, a sparse vector
                  being an object whatever the encoding; the client leaves an object as it is)
  "embed_sparse"  {"inputs", "truncate", "truncation_direction", "prompt_name"} (and threshold,
                  max_active_dims, input_type) -> [[{"index", "value"}, ...], ...], as TEI answers it

The options are the sparse task's (tasks/sparse.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from embedserve.handler.api.codec import dumps, option_value
from embedserve.handler.api.errors import RequestError, malformed
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, texts_body
from embedserve.handler.routes.openai import openai_list
from embedserve.handler.routes.schema import (EMBED_ERRORS, ServedModel, error_responses, examples, many, operation,
                                              option_schema, ref)
from embedserve.handler.tasks.embed import ENCODING_FORMATS, IGNORED_FIELDS
from embedserve.handler.tasks.sparse import INPUT_TYPES, SPARSE_FORMATS, SparseRequest, SparseVectors, parse_sparse_options

SPARSE = frozenset({Task.SPARSE})


def parse(route: Route, body: Any, content_type: str | None, method: str | None) -> SparseRequest:
    """A text/plain body (the native route), or a JSON object with the inputs under `input`
    (`inputs` on TEI's route) and the options; errors in the route's shape."""
    try:
        payload, texts, name = texts_body(route, body, content_type, method)
        options = parse_sparse_options(payload)
        if route is Route.OPENAI:
            option_value(payload, "encoding_format", str, ENCODING_FORMATS)
        if route.tei and options.sparse_format != "indices":
            raise malformed("'sparse_format' does not apply to /embed_sparse, which answers TEI's shape",
                            param="sparse_format")
        return SparseRequest(route, texts, options, field=name)
    except RequestError as err:
        err.tei = route.tei
        raise


def encode_list(request: SparseRequest, result: SparseVectors, model_name: str) -> bytes:
    """The native route's list, one sparse vector an input in the format the request asked for."""
    if result.names is not None:
        embeddings: list[Any] = [dict(zip(names, weights)) for names, weights in zip(result.names, result.weights)]
    else:
        embeddings = [{"indices": ids, "values": weights} for ids, weights in zip(result.ids, result.weights)]
    return openai_list([{"object": "sparse_embedding", "index": i, "embedding": embedding}
                        for i, embedding in enumerate(embeddings)], model_name, result.tokens)


def encode_tei(request: SparseRequest, result: SparseVectors, model_name: str) -> bytes:
    """TEI's /embed_sparse answer: per input, its entries as {"index", "value"}, by index."""
    # float32 scalars: orjson writes each in its shortest round-trip form, as the arrays of the dense answers.
    return dumps([[{"index": i, "value": v} for i, v in zip(ids.tolist(), weights)]
                  for ids, weights in zip(result.ids, result.weights)])


# --- the OpenAPI document --------------------------------------------------------------------------

OPTION_NOTES = {
    "threshold": "drop weights below this (default 0: every non-zero weight)",
    "max_active_dims": "keep at most this many entries per input, the largest",
    "sparse_format": "`indices`: {indices, values} (Qdrant, Milvus); `tokens`: {token: weight} (Elasticsearch "
                     "sparse_vector)",
    "input_type": "query or document: its prompt; an inference-free model looks queries up, no model pass",
}


def _options(model: ServedModel, tei: bool) -> dict[str, Any]:
    # long_input: the task reads it on every route, and takes "truncate" alone (refuse_long_input).
    shared = {key: option_schema(key, model)
              for key in ("truncate", "truncation_direction", "prompt_name", "long_input")}
    own = {
        "threshold": {"type": ["number", "null"], "minimum": 0, "default": 0,
                      "description": OPTION_NOTES["threshold"]},
        "max_active_dims": {"type": ["integer", "null"], "minimum": 1, "description": OPTION_NOTES["max_active_dims"]},
    }
    if not tei:
        own["sparse_format"] = {"enum": [*SPARSE_FORMATS, None], "default": SPARSE_FORMATS[0],
                                "description": OPTION_NOTES["sparse_format"]}
    if model.task is Task.SPARSE:
        own["input_type"] = {"enum": [*INPUT_TYPES, None], "description": OPTION_NOTES["input_type"]}
    return {**shared, **own}


def schemas(model: ServedModel) -> dict[str, Any]:
    if model.task not in (Task.SPARSE, Task.HYBRID):  # a hybrid model answers sparse vectors too
        return {}
    entry = {"type": "object", "required": ["index", "value"], "additionalProperties": False,
             "properties": {"index": {"type": "integer", "minimum": 0},  # a vocabulary id
                            "value": {"type": "number", "minimum": 0}}}
    indices = {"type": "object", "required": ["indices", "values"], "additionalProperties": False,
               "properties": {"indices": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                              "values": {"type": "array", "items": {"type": "number", "minimum": 0}}}}
    by_token = {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}}
    return {
        "SparseEmbeddingRequest": {
            "type": "object", "required": ["input"],
            "properties": {"input": {"anyOf": [ref("Text"), {**many(model), "items": ref("Text")}]},
                           **_options(model, tei=False),
                           **{key: {"type": ["string", "null"]} for key in IGNORED_FIELDS}}},
        "SparseEmbeddingList": {
            "type": "object", "required": ["object", "data", "model", "usage"],
            "properties": {
                "object": {"const": "list"}, "model": {"const": model.name},
                "data": {"type": "array", "items": {
                    "type": "object", "required": ["object", "index", "embedding"],
                    "properties": {"object": {"const": "sparse_embedding"}, "index": {"type": "integer"},
                                   "embedding": {"anyOf": [indices, by_token]}}}},
                "usage": {"type": "object"}}},
        "TEISparseRequest": {"type": "object", "required": ["inputs"],
                             "properties": {"inputs": ref("TEIInputs"), **_options(model, tei=True)}},
        "TEISparseEmbeddings": {"type": "array", "items": {"type": "array", "items": entry}},
    }


def _native_operations(model: ServedModel) -> dict[str, Any]:
    return {"post": operation(
        "embed_sparse_list", "Sparse embeddings: token ids and weights per input",
        {"application/json": {"schema": ref("SparseEmbeddingRequest"),
                              "examples": examples({"texts": {"input": ["The quick brown fox", "a lazy dog"]},
                                                    "tokens": {"input": "hello", "sparse_format": "tokens",
                                                               "max_active_dims": 32}})},
         "text/plain": {"schema": ref("Text"), "example": "hello world"}},
        {"schema": ref("SparseEmbeddingList")},
        error_responses(EMBED_ERRORS, Route.NATIVE, model.server, model=model,
                        parse=partial(parse, Route.NATIVE)))}


def _openai_operations(model: ServedModel) -> dict[str, Any]:
    request = {"allOf": [ref("SparseEmbeddingRequest"), {"properties": {
        "encoding_format": {"enum": [*ENCODING_FORMATS, None],
                            "description": "accepted for OpenAI clients; a sparse vector is an object either way"}}}]}
    return {"post": operation(
        "createSparseEmbedding", "Sparse embeddings in OpenAI's list: token ids and weights per input",
        {"application/json": {"schema": request, "example": {"input": ["The quick brown fox"], "model": model.name}}},
        {"schema": ref("SparseEmbeddingList")},
        error_responses(EMBED_ERRORS, Route.OPENAI, model.server, model=model, parse=partial(parse, Route.OPENAI)))}


def _tei_operations(model: ServedModel) -> dict[str, Any]:
    return {"post": operation(
        "embed_sparse", "TEI's /embed_sparse: per input, its non-zero entries",
        {"application/json": {"schema": ref("TEISparseRequest"), "example": {"inputs": ["hello world"]}}},
        {"schema": ref("TEISparseEmbeddings")},
        error_responses(EMBED_ERRORS, Route.TEI_EMBED_SPARSE, model.server, model=model,
                        parse=partial(parse, Route.TEI_EMBED_SPARSE)))}


ROUTES = (
    RouteSpec(Route.NATIVE, SPARSE, partial(parse, Route.NATIVE), encode_list, _native_operations),
    RouteSpec(Route.OPENAI, SPARSE, partial(parse, Route.OPENAI), encode_list, _openai_operations),
    RouteSpec(Route.TEI_EMBED_SPARSE, SPARSE, partial(parse, Route.TEI_EMBED_SPARSE), encode_tei, _tei_operations),
)
