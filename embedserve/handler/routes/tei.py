"""text-embeddings-inference's routes, in its shapes, errors in TEI's shape and statuses.

  "embed"       {"inputs": text | [text, ...], options} -> [[float, ...], ...]
  "similarity"  {"inputs": {"source_sentence", "sentences"}} -> the cosine of each sentence to the source
  "tokenize"    {"inputs", "add_special_tokens", "prompt_name"} -> each text's tokens (any model)
  "info"        the model, how it runs, the limits (any model, any method, any body)
  "rerank"      {"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction"}
                -> [{"index", "score", "text"?}], best first
  "predict"     {"inputs": text | [text, text] | [text | [text, text], ...], "raw_scores", "truncate",
                "truncation_direction"} -> [{"score", "label"}] per input, best first (one list for a
                single input, a list of lists for a batch)
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from embedserve.handler.api.codec import dumps, json_object, json_type, option_value, required
from embedserve.handler.api.errors import empty, malformed
from embedserve.handler.api.route import Route
from embedserve.handler.inputs.text import read_inputs, read_text, read_texts
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, describing, embedding_request, parsing
from embedserve.handler.routes.openai import encode_vector
from embedserve.handler.routes.schema import (DESCRIBE_ERRORS, EMBED_ERRORS, EMBED_OPTIONS, OPTION_NOTES,
                                              TOKENIZE_ERRORS, TOKENIZE_OPTIONS, ServedModel, error_responses, examples,
                                              many, one_vector_an_input, operation, options,
                                              quantizing_needs_normalizing, ref,
                                              scoring_option_schemas, texts_only)
from embedserve.handler.tasks.embed import IGNORED_FIELDS, OPTION_TYPES, EmbeddingRequest, Embeddings, parse_options
from embedserve.handler.tasks.score import Pair, Scores, ScoringRequest, parse_query, scoring_options

SCORE_TASKS = frozenset({Task.RERANK, Task.CLASSIFY})


def encode_embeddings(request: EmbeddingRequest, result: Embeddings, model_name: str) -> bytes:
    return dumps([encode_vector(row, request) for row in result.vectors])


def parse_similarity(body: Any, content_type: str | None, method: str | None) -> EmbeddingRequest:
    """The source sentence is input 0, the sentences follow. The answer is cosines, so options
    that change the vectors' encoding do not apply."""
    payload = json_object(body, content_type, method)
    if "inputs" not in payload:
        raise malformed("missing required field 'inputs'", param="inputs")
    value = payload["inputs"]
    if not isinstance(value, dict):
        raise malformed(f"'inputs' must be an object with 'source_sentence' and 'sentences', got {json_type(value)}",
                        param="inputs")
    source = value.get("source_sentence")
    if not isinstance(source, str):
        raise malformed(f"'inputs.source_sentence' must be a string, got {json_type(source)}",
                        param="inputs.source_sentence")
    read_text(source, "inputs.source_sentence")
    sentences = value.get("sentences")
    if not isinstance(sentences, list):
        raise malformed(f"'inputs.sentences' must be a list of strings, got {json_type(sentences)}",
                        param="inputs.sentences")
    inputs = (source, *read_inputs(sentences, "inputs.sentences", allow_token_ids=False))
    options = parse_options(payload)
    for key in ("output_dtype", "encoding_format"):
        if getattr(options, key) != OPTION_TYPES[key][1][0]:
            raise malformed(f"'{key}' does not apply to /similarity, which answers cosines", param=key)
    return EmbeddingRequest(Route.TEI_SIMILARITY, inputs, options, field="inputs.sentences")


def encode_similarity(request: EmbeddingRequest, result: Embeddings, model_name: str) -> bytes:
    """Cosines of each sentence to the source (input 0)."""
    vectors = result.vectors.astype(np.float64)
    norms = np.linalg.norm(vectors, axis=1).clip(min=1e-12)
    return dumps((vectors[1:] @ vectors[0] / norms[1:] / norms[0]).astype(np.float32))


def parse_rerank(body: Any, content_type: str | None, method: str | None) -> ScoringRequest:
    payload = json_object(body, content_type, method)
    common = scoring_options(payload)
    query = parse_query(payload)
    texts = read_texts(required(payload, "texts"), "texts")
    return ScoringRequest(Route.TEI_RERANK, tuple((query, text) for text in texts), "texts",
                          return_text=bool(option_value(payload, "return_text", bool)), **common)


def encode_rerank(request: ScoringRequest, result: Scores, model_name: str) -> bytes:
    relevance = result.values[:, 0]
    documents = request.documents
    return dumps([{"index": i, "score": float(relevance[i]), **({"text": documents[i]} if request.return_text else {})}
                  for i in best_first(relevance, request.top_n)])


def best_first(relevance: np.ndarray, top_n: int | None) -> list[int]:
    """Indices by descending relevance (ties: request order), the first `top_n`."""
    order = sorted(range(len(relevance)), key=lambda i: (-float(relevance[i]), i))
    return order if top_n is None else order[:top_n]


def parse_predict(body: Any, content_type: str | None, method: str | None) -> ScoringRequest:
    payload = json_object(body, content_type, method)
    common = scoring_options(payload)
    inputs, batch = _predict_inputs(required(payload, "inputs"))
    return ScoringRequest(Route.TEI_PREDICT, inputs, "inputs", batch=batch, **common)


def _predict_inputs(value: Any) -> tuple[tuple[Pair, ...], bool]:
    """TEI's forms: a text; a pair [a, b]; a batch of texts and pairs. The answer is one list for
    the first two, a list per input for a batch."""
    if isinstance(value, str):
        return ((read_text(value, "inputs"), None),), False
    if not isinstance(value, list) or not value:
        raise (empty if isinstance(value, list) else malformed)(
            f"'inputs' must be a text, a pair [text, text], or a non-empty list of them, got {json_type(value)}",
            param="inputs")
    if len(value) == 2 and all(isinstance(item, str) for item in value):
        return ((read_text(value[0], "inputs[0]"), read_text(value[1], "inputs[1]")),), False
    inputs: list[Pair] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            inputs.append((read_text(item, f"inputs[{i}]"), None))
        elif isinstance(item, list) and len(item) == 2 and all(isinstance(text, str) for text in item):
            inputs.append((read_text(item[0], f"inputs[{i}][0]"), read_text(item[1], f"inputs[{i}][1]")))
        else:
            raise malformed(f"'inputs[{i}]' must be a text or a pair [text, text], got {json_type(item)}"
                            f"{f' of {len(item)} items' if isinstance(item, list) else ''}", param=f"inputs[{i}]")
    return tuple(inputs), True


def encode_predict(request: ScoringRequest, result: Scores, model_name: str) -> bytes:
    per_input = [sorted(({"score": float(score), "label": label} for label, score in zip(result.labels, row)),
                        key=lambda item: -item["score"]) for row in result.values]
    return dumps(per_input if request.batch else per_input[0])


def _embed(model: ServedModel) -> dict[str, Any]:
    example = {"inputs": ["hello", "world"], "truncate": True, "truncation_direction": "left"}
    return {"post": operation(
        "teiEmbed", "Embeddings, TEI's /embed: one vector a text",
        {"application/json": {"schema": ref("TEIEmbedRequest"), "examples": examples({"texts": example})}},
        {"schema": ref("TEIEmbeddings"), "example": [[0.0213, -0.0452, 0.0088]]},
        error_responses(EMBED_ERRORS, Route.TEI_EMBED, model.server, model=model, parse=PARSE_EMBED))}


def _similarity(model: ServedModel) -> dict[str, Any]:
    example = {"inputs": {"source_sentence": "a cat", "sentences": ["a kitten", "a car"]}}
    return {"post": operation(
        "teiSimilarity", "Cosine of each sentence's embedding to the source sentence's, TEI's /similarity",
        {"application/json": {"schema": ref("SimilarityRequest"), "examples": examples({"sentences": example})}},
        {"schema": {"type": "array", "items": {"type": "number", "minimum": -1.0001, "maximum": 1.0001}},
         "example": [0.77, 0.35]},
        error_responses(EMBED_ERRORS, Route.TEI_SIMILARITY, model.server, model=model, parse=PARSE_SIMILARITY))}


def _tokenize(model: ServedModel) -> dict[str, Any]:
    example = [[{"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
                {"id": 7592, "text": "hello", "special": False, "start": 0, "stop": 5}]]
    return {"post": operation(
        "teiTokenize", "Tokens of each text, TEI's /tokenize: ids, token texts, character offsets",
        {"application/json": {"schema": ref("TokenizeRequest"),
                              "examples": examples({"text": {"inputs": "hello world"}})}},
        {"schema": ref("Tokens"), "example": example},
        error_responses(TOKENIZE_ERRORS, Route.TEI_TOKENIZE, model.server, model=model, parse=PARSE_TOKENIZE))}


def _info(model: ServedModel) -> dict[str, Any]:
    def info(operation_id: str) -> dict[str, Any]:
        return operation(operation_id, "The model, how it runs, and the limits (TEI's /info keys and more); any "
                                       "method, any body", None, {"schema": ref("Info")},
                         error_responses(DESCRIBE_ERRORS, Route.TEI_INFO, model.server))
    return {"get": info("infoGet"), "post": info("infoPost")}


def _predict(model: ServedModel) -> dict[str, Any]:
    return {"post": operation(
        "teiPredict", "Scores per label of a text or a (text, text) pair, TEI's /predict, best first",
        {"application/json": {"schema": ref("PredictRequest"),
                              "examples": examples({"pair": {"inputs": ["what is a cat", "a small animal"]}})}},
        {"schema": ref("PredictAnswer")},
        error_responses(EMBED_ERRORS, Route.TEI_PREDICT, model.server, model=model, parse=PARSE_PREDICT))}


def _rerank(model: ServedModel) -> dict[str, Any]:
    example = {"query": "what is a cat", "texts": ["a small animal", "a car"]}
    return {"post": operation(
        "teiRerank", "Relevance of each text to the query, TEI's /rerank, best first",
        {"application/json": {"schema": ref("RerankRequest"), "examples": examples({"texts": example})}},
        {"schema": ref("RerankAnswer")},
        error_responses(EMBED_ERRORS, Route.TEI_RERANK, model.server, model=model, parse=PARSE_RERANK))}


def _checked_only(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    """An embedding option as /tokenize checks it, which it then ignores: its type and its
    choices, not the bounds of what a model embeds (the most dimensions, the longest overlap, as
    many `chunk_spans` lists as inputs, a dense model's chunking)."""
    schema = {name: value for name, value in schema.items() if name not in ("maximum", "maxItems", "default")}
    if key == "long_input":
        schema["enum"] = [*OPTION_TYPES[key][1], None]
    if key == "modality":
        schema = texts_only(schema)
    return {**schema, "description": f"{OPTION_NOTES[key]}; checked, no effect here"}


def schemas(model: ServedModel) -> dict[str, Any]:
    settings, many_ = model.settings, many(model)
    option = options(model)
    answered = one_vector_an_input(option)  # TEI's answers: a vector per input
    # OpenAI's `model` and `user`, checked to be strings on every embedding route (routes/base.py), then ignored.
    ignored = {key: {"type": ["string", "null"], "description": OPTION_NOTES[key]} for key in IGNORED_FIELDS}
    found = {
        "TEIEmbedRequest": {
            "type": "object", "required": ["inputs"],
            "properties": {"inputs": ref("TEIInputs"), **{key: answered[key] for key in EMBED_OPTIONS}, **ignored},
            **quantizing_needs_normalizing(model)},
        "SimilarityRequest": {
            "type": "object", "required": ["inputs"],
            "properties": {
                "inputs": {"type": "object", "required": ["source_sentence", "sentences"], "properties": {
                    "source_sentence": ref("Text"),
                    "sentences": {**many_, "maxItems": settings.max_inputs_per_request - 1, "items": ref("Text")}}},
                **{key: answered[key] for key in EMBED_OPTIONS if key not in ("output_dtype", "encoding_format")},
                **{key: {"enum": [OPTION_TYPES[key][1][0], None], "description": "only the default: the answer is "
                                                                                 "cosines"}
                   for key in ("output_dtype", "encoding_format")}, **ignored}},
        "TokenizeRequest": {
            "type": "object", "required": ["inputs"],
            "properties": {"inputs": ref("TEIInputs"), **{key: option[key] for key in TOKENIZE_OPTIONS},
                           **{key: _checked_only(key, option[key]) for key in EMBED_OPTIONS if key not in TOKENIZE_OPTIONS},
                           **ignored},
            "description": "the other embedding options are checked for their type and choices, and have no effect "
                           "here"},
        "TEIEmbeddings": {"type": "array", "minItems": 1, "maxItems": settings.max_inputs_per_request,
                          "items": ref("Vector")},
        "Tokens": {"type": "array", "items": {"type": "array", "items": {
            "type": "object", "required": ["id", "text", "special", "start", "stop"],
            "properties": {"id": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                           "special": {"type": "boolean"}, "start": {"type": ["integer", "null"]},
                           "stop": {"type": ["integer", "null"]}},
            "description": "start, stop: character offsets in the text (null for special tokens)"}}},
    }
    if model.task is Task.EMBED:
        return found
    common = scoring_option_schemas(model)
    pair = {"type": "array", "prefixItems": [ref("Text"), ref("Text")], "minItems": 2, "maxItems": 2}
    label_score = {"type": "object", "required": ["score", "label"],
                   "properties": {"score": {"type": "number"}, "label": {"enum": list(model.labels)}}}
    return {
        **found,
        "PredictRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"anyOf": [pair, {**many_, "items": pair}]} if model.instructed else
            {"anyOf": [ref("Text"), pair, {**many_, "items": {"anyOf": [ref("Text"), pair]}}]},
            **common}},
        "PredictAnswer": {"anyOf": [{"type": "array", "items": label_score},
                                    {"type": "array", "items": {"type": "array", "items": label_score}}]},
        "RerankRequest": {"type": "object", "required": ["query", "texts"], "properties": {
            "query": ref("Text"), "texts": {**many_, "items": ref("Text")},
            "return_text": {"type": ["boolean", "null"]}, **common}},
        "RerankAnswer": {"type": "array", "items": {"type": "object", "required": ["index", "score"], "properties": {
            "index": {"type": "integer", "minimum": 0}, "score": {"type": "number"}, "text": {"type": "string"}}}},
    }


PARSE_EMBED = partial(embedding_request, Route.TEI_EMBED, allow_token_ids=False)
PARSE_SIMILARITY = parsing(Route.TEI_SIMILARITY, parse_similarity)
PARSE_TOKENIZE = partial(embedding_request, Route.TEI_TOKENIZE, allow_token_ids=False)
PARSE_RERANK = parsing(Route.TEI_RERANK, parse_rerank)
PARSE_PREDICT = parsing(Route.TEI_PREDICT, parse_predict)
ROUTES = (
    RouteSpec(Route.TEI_EMBED, frozenset({Task.EMBED}), PARSE_EMBED, encode_embeddings, _embed),
    RouteSpec(Route.TEI_SIMILARITY, frozenset({Task.EMBED}), PARSE_SIMILARITY, encode_similarity, _similarity),
    RouteSpec(Route.TEI_TOKENIZE, frozenset(), PARSE_TOKENIZE, operations=_tokenize),
    describing(Route.TEI_INFO, _info),
    RouteSpec(Route.TEI_RERANK, frozenset({Task.RERANK}), PARSE_RERANK, encode_rerank, _rerank),
    RouteSpec(Route.TEI_PREDICT, SCORE_TASKS, PARSE_PREDICT, encode_predict, _predict),
)
