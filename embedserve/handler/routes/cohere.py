"""Cohere's routes: rerank (Cohere's and Jina's) and embed (what Cohere's ClientV2.embed posts).

Rerank, POST .../v1/rerank (Cohere v1, Jina) and .../v2/rerank, the same body and answer:
{"model", "query", "documents": [text | {"text"}], "top_n", "return_documents", "instruction",
"raw_scores", "truncate", "truncation_direction"} -> {"id", "model", "results": [{"index",
"relevance_score", "document"?}], "meta", "usage"}, best first. "instruction" only for a causal
language model reranker (its chat template's system message).

Embed, POST .../v2/embed: {"model", "texts" | "images" (data URIs, for a model that reads images),
"input_type", "embedding_types", "output_dimension", "truncate"} -> {"id", "embeddings": {type:
rows}, "texts"?, "meta", "response_type": "embeddings_by_type"}. `input_type` picks the model's
prompt of that role where it has one (search_query: its "query" prompt, ...); "image" goes with
images. Each embedding type is the same vectors, quantized as the native route's output_dtype.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

from embedserve.handler.api.codec import dumps, json_object, json_type, option_value, required, short
from embedserve.handler.api.errors import malformed, unprocessable
from embedserve.handler.api.quantize import SCALAR_DTYPES, quantize
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, parsing
from embedserve.handler.routes.schema import (EMBED_ERRORS, ServedModel, any_case, error_responses, examples, many,
                                              operation, ref, scoring_option_schemas)
from embedserve.handler.routes.tei import best_first
from embedserve.handler.tasks.embed import INPUT_TYPE_PROMPTS, IGNORED_FIELDS, EmbeddingRequest, Embeddings, Options
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


# Cohere's embedding types: its float rows, the native route's codes, and base64 (float32 bytes).
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
# Cohere's truncate, as this server's truncate and truncation_direction.
TRUNCATE = {"none": (False, "right"), "start": (True, "left"), "end": (True, "right")}


@dataclass(frozen=True)
class CohereEmbedRequest(EmbeddingRequest):
    embedding_types: tuple[str, ...] = ("float",)


def parse_embed(body: Any, content_type: str | None, method: str | None) -> CohereEmbedRequest:
    payload = json_object(body, content_type, method)
    for key in IGNORED_FIELDS:
        option_value(payload, key, str)
    option_value(payload, "priority", int, minimum=0)  # the queue's order at Cohere: none here
    input_type = option_value(payload, "input_type", str, tuple(INPUT_TYPE_PROMPTS))
    for key, instead in (("inputs", "'texts' or 'images'"), ("max_tokens", "'truncate'")):
        if payload.get(key) is not None:
            raise unprocessable(f"'{key}' is not served here; send {instead}", param=key)
    if (payload.get("texts") is None) == (payload.get("images") is None):
        raise malformed("send one of 'texts' and 'images'", param="texts")
    field = "images" if payload.get("images") is not None else "texts"
    if (input_type == "image") != (field == "images") and input_type is not None:
        raise unprocessable(f"'input_type' {input_type} does not go with '{field}': 'image' is for 'images'",
                            param="input_type")
    items = read_texts(payload[field], field)  # an image's data URI is read by the image kind
    types = _embedding_types(payload.get("embedding_types"))
    cut = option_value(payload, "truncate", str, tuple(TRUNCATE), case_insensitive=True)
    truncate, direction = TRUNCATE[cut] if cut else (None, "right")
    options = Options(truncate=truncate, truncation_direction=direction,
                      dimensions=option_value(payload, "output_dimension", int),
                      # int8 and uint8 quantize unit vectors, as Cohere's are: every type of the answer then is
                      normalize=True if set(types) & set(SCALAR_DTYPES) else None,
                      modality="image" if field == "images" else "text", input_type=input_type)
    return CohereEmbedRequest(Route.EMBED_V2, tuple(items), options, field=field, embedding_types=types)


def _embedding_types(value: Any) -> tuple[str, ...]:
    if value is None:
        return ("float",)
    if not isinstance(value, list) or not value:
        raise malformed(f"'embedding_types' must be a non-empty list of {', '.join(EMBEDDING_TYPES)}, got "
                        f"{json_type(value)}", param="embedding_types")
    for i, kind in enumerate(value):
        if kind not in EMBEDDING_TYPES:
            raise malformed(f"'embedding_types[{i}]' must be one of {', '.join(EMBEDDING_TYPES)}, got {short(kind)}",
                            param=f"embedding_types[{i}]")
    return tuple(dict.fromkeys(value))


def encode_embed(request: CohereEmbedRequest, result: Embeddings, model_name: str) -> bytes:
    """Each asked type of the same float vectors, under its name."""
    vectors = result.vectors
    embeddings = {kind: vectors if kind == "float" else
                  [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in vectors]
                  if kind == "base64" else quantize(vectors, kind) for kind in request.embedding_types}
    billed = {"images": len(request.inputs)} if request.field == "images" else {"input_tokens": result.tokens}
    return dumps({"id": str(uuid.uuid4()), "embeddings": embeddings,
                  **({"texts": list(request.inputs)} if request.field == "texts" else {}),
                  "meta": {"api_version": {"version": "2"}, "billed_units": billed},
                  "response_type": "embeddings_by_type"})


def cohere_operations(route: Route, model: ServedModel, parse=None) -> dict[str, Any]:
    """The rerank operation of `route`; `parse` the route's parser where it is not ROUTES_BY's."""
    example = {"query": "what is a cat", "documents": ["a small animal", "a car"], "top_n": 1}
    return {"post": operation(
        "rerankV2" if route is Route.RERANK_V2 else "rerankV1",
        "Relevance of each document to the query, Cohere's and Jina's rerank, best first",
        {"application/json": {"schema": ref("CohereRerankRequest"), "examples": examples({"documents": example})}},
        {"schema": ref("CohereRerankAnswer")},
        error_responses(EMBED_ERRORS, route, model.server, model=model, parse=parse or ROUTES_BY[route].parse))}


def embed_operations(model: ServedModel) -> dict[str, Any]:
    example = {"texts": ["what is a cat"], "input_type": "search_query", "embedding_types": ["float", "int8"]}
    return {"post": operation(
        "embedV2", "Vectors of texts, or of images for a model that reads them: Cohere's v2 embed",
        {"application/json": {"schema": ref("CohereEmbedRequest"), "examples": examples({"texts": example})}},
        {"schema": ref("CohereEmbedAnswer")},
        error_responses(EMBED_ERRORS, Route.EMBED_V2, model.server, model=model, parse=EMBED.parse))}


def embed_schemas(model: ServedModel) -> dict[str, Any]:
    text_types = [kind for kind in INPUT_TYPE_PROMPTS if kind != "image"]
    texts = {"required": ["texts"], "properties": {"texts": {**many(model), "items": ref("Text")},
                                                 "images": {"type": "null"},
                                                 "input_type": {"enum": [*text_types, None]}}}
    images = {"required": ["images"], "properties": {"images": ref("ImageInputs"), "texts": {"type": "null"},
                                                   "input_type": {"enum": ["image", None]}}}
    rows = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
    return {
        "CohereEmbedRequest": {
            "type": "object", "anyOf": [texts, images] if model.reads_images else [texts],
            "properties": {
                "texts": {"type": ["array", "null"]}, "images": {"type": ["array", "null"]},
                "input_type": {"enum": [*INPUT_TYPE_PROMPTS, None], "description": "search_query, search_document, "
                               "classification, clustering: the model's prompt of that role where it has one "
                               "(search_query: 'query', search_document: 'document' or 'passage'), else its "
                               "default; image: with images"},
                "embedding_types": {"type": ["array", "null"], "minItems": 1, "items": {"enum": list(EMBEDDING_TYPES)},
                                    "description": "missing or null: float; int8 and uint8 normalize the vectors"},
                "output_dimension": {"type": ["integer", "null"], "minimum": 1, "maximum": model.dimension},
                "truncate": {"type": ["string", "null"], "pattern": "|".join(f"^{any_case(cut)}$" for cut in TRUNCATE),
                             "description": "NONE refuses an input over the max input length (413); START and END "
                                            "cut its start or end; missing or null: the server's setting"},
                "priority": {"type": ["integer", "null"], "minimum": 0, "description": "accepted and ignored"},
                "inputs": {"type": "null", "description": "Cohere's content objects: not served"},
                "max_tokens": {"type": "null", "description": "not served: truncate cuts at the max input length"},
                **{key: {"type": ["string", "null"]} for key in IGNORED_FIELDS}}},
        "CohereEmbedAnswer": {"type": "object", "required": ["id", "embeddings", "response_type"], "properties": {
            "id": {"type": "string"}, "response_type": {"const": "embeddings_by_type"}, "meta": {"type": "object"},
            "texts": {"type": "array", "items": {"type": "string"}},
            "embeddings": {"type": "object", "properties": {
                **{kind: rows for kind in EMBEDDING_TYPES if kind != "base64"},
                "base64": {"type": "array", "items": {"type": "string", "contentEncoding": "base64"}}}}}},
    }


def schemas(model: ServedModel) -> dict[str, Any]:
    if model.task is Task.EMBED:
        return embed_schemas(model)
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


EMBED = RouteSpec(Route.EMBED_V2, frozenset({Task.EMBED}), parsing(Route.EMBED_V2, parse_embed), encode_embed,
                  embed_operations)
ROUTES = (*(RouteSpec(route, frozenset({Task.RERANK}), parsing(route, partial(parse_rerank, route)), encode_rerank,
                      partial(cohere_operations, route))
            for route in (Route.RERANK_V1, Route.RERANK_V2)), EMBED)
ROUTES_BY = {spec.route: spec for spec in ROUTES}
