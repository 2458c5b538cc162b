"""The native route: POST /<model> (and /<model>/<version>).

{"input": ...} JSON, as OpenAI's route takes it and answered in OpenAI's list shape; or a text/plain
body, one text. Hugging Face clients post TEI bodies to the bare model URL: a body with `inputs`
and no `input` is TEI's /embed, answered in TEI's shape.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, embedding_request
from embedserve.handler.routes.openai import encode_list
from embedserve.handler.routes.schema import (EMBED_ERRORS, ServedModel, embedding_examples, error_responses, examples,
                                              operation, ref)

PARSE = partial(embedding_request, Route.NATIVE, allow_token_ids=True, tei_body=True)


def _operations(model: ServedModel) -> dict[str, Any]:
    tei_body = {"allOf": [ref("TEIEmbedRequest"), {"not": {"required": ["input"]}}]}
    return {"post": operation(
        "embed", "Embeddings: OpenAI's list shape; a TEI body (`inputs`, no `input`) gets TEI's answer",
        {"application/json": {"schema": {"anyOf": [ref("EmbeddingRequest"), tei_body]},
                              "examples": examples(embedding_examples(model) | {"tei": {"inputs": ["hello world"]}})},
         "text/plain": {"schema": ref("Text"), "example": "hello world"}},
        {"schema": {"anyOf": [ref("EmbeddingList"), ref("TEIEmbeddings")]}},
        error_responses(EMBED_ERRORS, Route.NATIVE, model.server, also_tei=True, model=model, parse=PARSE))}


ROUTES = (RouteSpec(Route.NATIVE, frozenset({Task.EMBED}), PARSE, encode_list, _operations),)
