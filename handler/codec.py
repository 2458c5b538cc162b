"""Request codec: turn one raw request into an EmbeddingRequest, and embeddings into a response body.

Plain Python + numpy, no torch and no TorchServe, so every shape is unit-testable.

Routes (the path after `/predictions/<model>/<version>/`, which TorchServe passes as the
`url_path` request header):
  ""               native: {"input": str | [str, ...]} as JSON, or a text/plain body (one text)
  "v1/embeddings"  OpenAI embeddings API

Body decoding: a `text/*` content type means the whole body is one text; anything else is
parsed as JSON. Unknown JSON fields (OpenAI's `user`, say) are accepted and ignored.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import numpy as np

from handler.errors import RequestError, invalid, not_found

ENCODING_FORMATS = ("float", "base64")


class Route(Enum):
    NATIVE = ""
    OPENAI = "v1/embeddings"


@dataclass(frozen=True)
class EmbeddingRequest:
    route: Route
    texts: tuple[str, ...]
    encoding_format: str = "float"
    # Matryoshka truncation; None keeps the model's full dimension.
    dimensions: int | None = None


def parse_route(url_path: str | None) -> Route:
    path = (url_path or "").strip("/")
    for route in Route:
        if route.value == path:
            return route
    raise not_found(f"unknown route '{path}'; known: '' (native), 'v1/embeddings' (OpenAI)")


def parse_request(body: Any, content_type: str | None, url_path: str | None) -> EmbeddingRequest:
    """Decode and validate one request; raise RequestError naming the faulty field."""
    route = parse_route(url_path)
    payload = decode_body(body, content_type)
    if isinstance(payload, str):
        return EmbeddingRequest(route, (_check_text(payload, "body"),))
    if not isinstance(payload, dict):
        raise invalid("request body must be a JSON object with an 'input' field", param="body")
    if "input" not in payload:
        raise invalid("missing required field 'input' (a string or a list of strings)", param="input")
    return EmbeddingRequest(
        route=route,
        texts=_parse_input(payload["input"]),
        encoding_format=_parse_encoding_format(payload.get("encoding_format")),
        dimensions=_parse_dimensions(payload.get("dimensions")),
    )


def decode_body(body: Any, content_type: str | None) -> Any:
    """Return a str for a text/* body, else the parsed JSON value."""
    if body is None:
        # TorchServe turns a form-encoded body (curl -d without a content type) into form
        # fields, leaving no body; say how to send it instead.
        raise invalid(
            "request body is empty or form-encoded; send JSON with 'Content-Type: application/json', "
            "or one text with 'Content-Type: text/plain'",
            param="body",
        )
    if isinstance(body, (dict, list)):  # TorchServe already parsed the JSON
        return body
    is_text = (content_type or "").lower().startswith("text/")
    if isinstance(body, (bytes, bytearray)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as err:
            raise invalid(f"request body is not valid UTF-8 (byte {err.start})", param="body") from None
    if not isinstance(body, str):
        raise invalid("request body has an unsupported type", param="body")
    if is_text:
        return body
    try:
        return json.loads(body)
    except json.JSONDecodeError as err:
        raise invalid(
            f"request body is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
            "send application/json, or text/plain for a single text",
            param="body",
        ) from None


def _parse_input(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_check_text(value, "input"),)
    if not isinstance(value, list):
        raise invalid(f"'input' must be a string or a list of strings, got {_json_type(value)}", param="input")
    if not value:
        raise invalid("'input' must not be an empty list", param="input")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise invalid(f"'input[{i}]' must be a string, got {_json_type(item)}", param=f"input[{i}]")
        _check_text(item, f"input[{i}]")
    return tuple(value)


def _check_text(text: str, param: str) -> str:
    if not text:
        raise invalid(f"'{param}' must not be an empty string", param=param)
    return text


def _parse_encoding_format(value: Any) -> str:
    if value is None:
        return "float"
    if value not in ENCODING_FORMATS:
        raise invalid(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got {value!r}",
                      param="encoding_format")
    return value


def _parse_dimensions(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"'dimensions' must be a positive integer, got {value!r}", param="dimensions")
    return value


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def encode_embeddings(
    vectors: np.ndarray, *, model_name: str, prompt_tokens: int, encoding_format: str = "float"
) -> bytes:
    """The OpenAI list shape for (n, dim) float32 vectors; native and OpenAI routes share it."""
    data = [
        {"object": "embedding", "index": i, "embedding": _encode_vector(row, encoding_format)}
        for i, row in enumerate(vectors)
    ]
    body = {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _encode_vector(row: np.ndarray, encoding_format: str) -> Sequence[float] | str:
    if encoding_format == "base64":
        # OpenAI's encoding: little-endian float32 bytes, base64.
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()


def encode_error(error: RequestError) -> bytes:
    return json.dumps(error.openai_body(), separators=(",", ":")).encode()
