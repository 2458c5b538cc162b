"""OpenAI's embeddings API: POST .../v1/embeddings.

{"input": text | [text, ...] | [id, ...] | [[id, ...], ...], "model", "user", "dimensions",
"encoding_format", and this server's options} -> {"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage"}. `model` and `user` must be strings and are
ignored (the URL names the model); other unknown fields are accepted and ignored.
"""

from __future__ import annotations

import base64
from functools import partial
from typing import Any

import numpy as np

from embedserve.handler.api.codec import dumps
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, embedding_request
from embedserve.handler.routes.schema import (EMBED_ERRORS, EMBED_OPTIONS, OBJECTS_TAKE_NO_MODALITY, OPTION_NOTES,
                                              RANGE, SPANS_NEED_LATE_CHUNKING, ServedModel, embedding_examples,
                                              error_responses, examples, images_need_data_uris, list_example,
                                              operation, options, quantizing_needs_normalizing, ref)
from embedserve.handler.tasks.embed import IGNORED_FIELDS, EmbeddingRequest, Embeddings


def encode_list(request: EmbeddingRequest, result: Embeddings, model_name: str) -> bytes:
    """OpenAI's list of embeddings (also the native route's answer); with "long_input": "chunk",
    each item also says how many windows its input was cut into; with "late_chunk", an item per
    span, in order, saying its input and its token and character ranges."""
    items = [{"object": "embedding", "index": i, "embedding": encode_vector(row, request)}
             for i, row in enumerate(result.vectors)]
    for item, windows in zip(items, result.windows or ()):
        item["windows"] = windows
    spans = ((owner, span) for owner, own in enumerate(result.spans or ()) for span in own)
    for item, (owner, span) in zip(items, spans):
        item.update({"input": owner, "tokens": span.tokens, "chars": span.chars})
    return openai_list(items, model_name, result.tokens)


def openai_list(items: list[dict[str, Any]], model_name: str, tokens: int) -> bytes:
    """OpenAI's list envelope around the answer's items: every list-shaped answer of every task."""
    return dumps({"object": "list", "data": items, "model": model_name,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def encode_vector(row: np.ndarray, request: EmbeddingRequest) -> np.ndarray | str:
    if request.options.encoding_format == "base64":
        # Floats are OpenAI's encoding: little-endian float32 bytes. Codes go the same way on the
        # OpenAI route, because OpenAI clients (the official one asks for base64 by default)
        # decode every base64 embedding as float32; on the other routes they go compact, one
        # byte a code, to callers that asked for base64 knowing the dtype.
        compact = row.dtype.kind != "f" and request.route is not Route.OPENAI
        data = row if compact else row.astype("<f4")
        return base64.b64encode(data.tobytes()).decode("ascii")
    return np.ascontiguousarray(row)  # serialized by orjson straight from the array


PARSE = partial(embedding_request, Route.OPENAI, allow_token_ids=True)


def _operations(model: ServedModel) -> dict[str, Any]:
    return {"post": operation(
        "createEmbedding", "Embeddings, OpenAI's embeddings API",
        {"application/json": {"schema": ref("EmbeddingRequest"),
                              "examples": examples(embedding_examples(model))}},
        {"schema": ref("EmbeddingList"), "example": list_example(model)},
        error_responses(EMBED_ERRORS, Route.OPENAI, model.server, model=model, parse=PARSE))}


# What an item of a late chunked answer says of its span.
SPAN_FIELDS = {
    "input": {"type": "integer", "minimum": 0, "description": "with \"long_input\": \"late_chunk\": the input this "
              "span is of (`index` is the item's place in the list)"},
    "tokens": {**RANGE, "description": "with \"long_input\": \"late_chunk\": the span's [start, end) tokens of its "
               "text (the prompt and special tokens not counted)"},
    "chars": {"anyOf": [RANGE, {"type": "null"}], "description": "with \"long_input\": \"late_chunk\": the span's "
              "[start, end) characters of its text; null for token ids"},
}


def schemas(model: ServedModel) -> dict[str, Any]:
    """The request and the answer, shared with the native route."""
    option = options(model)
    ignored = {key: {"type": ["string", "null"], "description": OPTION_NOTES[key]} for key in IGNORED_FIELDS}
    settings = model.settings
    return {
        "EmbeddingRequest": {
            "type": "object", "required": ["input"],
            "properties": {"input": {"anyOf": [ref("Input"), ref("ItemInputs"),
                                               *([ref("ImageInputs")] if model.reads_images else [])]},
                           **{key: option[key] for key in EMBED_OPTIONS}, **ignored},
            "allOf": [quantizing_needs_normalizing(model), SPANS_NEED_LATE_CHUNKING, OBJECTS_TAKE_NO_MODALITY,
                      *([images_need_data_uris(model)] if model.reads_images else [])],
            "description": "other fields are accepted and ignored"},
        "EmbeddingList": {
            "type": "object", "required": ["object", "data", "model", "usage"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "minItems": 1, "maxItems": settings.max_inputs_per_request, "items": {
                    "type": "object", "required": ["object", "index", "embedding"],
                    "properties": {"object": {"const": "embedding"}, "index": {"type": "integer", "minimum": 0},
                                   "embedding": ref("Vector"),
                                   "windows": {"type": "integer", "minimum": 1, "description": "with \"long_input\": "
                                               "\"chunk\": the windows the input was cut into"},
                                   **SPAN_FIELDS}}},
                "model": {"const": model.name},
                "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
                    "prompt_tokens": {"type": "integer", "minimum": 1}, "total_tokens": {"type": "integer",
                                                                                         "minimum": 1}}}}},
    }


ROUTES = (RouteSpec(Route.OPENAI, frozenset({Task.EMBED}), PARSE, encode_list, _operations),)
