"""OpenAI's embeddings API: POST .../v1/embeddings.

{"input": text | [text, ...] | [id, ...] | [[id, ...], ...], "model", "user", "dimensions",
"encoding_format", and this server's options} -> {"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage"}. `model` and `user` must be strings and are
ignored (the URL names the model); other unknown fields are accepted and ignored.
"""

from __future__ import annotations

import base64
from functools import partial

import numpy as np

from embedserve.handler.api.codec import dumps
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.base import RouteSpec, embedding_request
from embedserve.handler.tasks.embed import EmbeddingRequest, Embeddings


def encode_list(request: EmbeddingRequest, result: Embeddings, model_name: str) -> bytes:
    """OpenAI's list of embeddings (also the native route's answer)."""
    return dumps({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode_vector(row, request)}
                 for i, row in enumerate(result.vectors)],
        "model": model_name,
        "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens},
    })


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


ROUTES = (
    RouteSpec(Route.OPENAI, frozenset({Task.EMBED}),
              partial(embedding_request, Route.OPENAI, allow_token_ids=True), encode_list),
)
