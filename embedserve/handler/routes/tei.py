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

from embedserve.handler.api.codec import check_text, dumps, json_object, json_type, option_value, required
from embedserve.handler.api.errors import empty, malformed
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, describing, embedding_request, parsing
from embedserve.handler.routes.openai import encode_vector
from embedserve.handler.tasks.embed import (OPTION_TYPES, EmbeddingRequest, Embeddings, parse_inputs,
                                            parse_options)
from embedserve.handler.tasks.score import Pair, Scores, ScoringRequest, parse_query, parse_texts, scoring_options

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
    check_text(source, "inputs.source_sentence")
    sentences = value.get("sentences")
    if not isinstance(sentences, list):
        raise malformed(f"'inputs.sentences' must be a list of strings, got {json_type(sentences)}",
                        param="inputs.sentences")
    inputs = (source, *parse_inputs(sentences, "inputs.sentences", allow_token_ids=False))
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
    texts = parse_texts(required(payload, "texts"), "texts")
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


def encode_predict(request: ScoringRequest, result: Scores, model_name: str) -> bytes:
    per_input = [sorted(({"score": float(score), "label": label} for label, score in zip(result.labels, row)),
                        key=lambda item: -item["score"]) for row in result.values]
    return dumps(per_input if request.batch else per_input[0])


ROUTES = (
    RouteSpec(Route.TEI_EMBED, frozenset({Task.EMBED}),
              partial(embedding_request, Route.TEI_EMBED, allow_token_ids=False), encode_embeddings),
    RouteSpec(Route.TEI_SIMILARITY, frozenset({Task.EMBED}), parsing(Route.TEI_SIMILARITY, parse_similarity),
              encode_similarity),
    RouteSpec(Route.TEI_TOKENIZE, frozenset(), partial(embedding_request, Route.TEI_TOKENIZE, allow_token_ids=False)),
    describing(Route.TEI_INFO),
    RouteSpec(Route.TEI_RERANK, frozenset({Task.RERANK}), parsing(Route.TEI_RERANK, parse_rerank), encode_rerank),
    RouteSpec(Route.TEI_PREDICT, SCORE_TASKS, parsing(Route.TEI_PREDICT, parse_predict), encode_predict),
)
