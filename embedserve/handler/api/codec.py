"""Request codec: one raw request in, a validated EmbeddingRequest out; results in, wire bytes out.

Plain Python + numpy, no torch and no TorchServe, so every shape is unit-testable. What needs
the model (dimension, vocabulary, prompts, token counts) is checked in prepare.py.

Routes, by the path after `/predictions/<model>/<version>/` (TorchServe's `url_path` header):
  ""               native: {"input": ...} JSON or a text/plain body; TEI's {"inputs": ...} too
  "v1/embeddings"  OpenAI embeddings API
  "embed"          TEI /embed
  "tokenize"       TEI /tokenize
  "similarity"     TEI /similarity: {"inputs": {"source_sentence", "sentences"}} -> cosine of each sentence
                   to the source
  "info"           TEI /info (any method, any body)
  "openapi.json"   the OpenAPI document of these routes (any method, any body; openapi.py)
  "rerank", "predict", "v1/rerank", "v2/rerank"
                   a reranker's or classifier's routes (TEI's, Cohere's and Jina's shapes; scoring.py)

Body decoding: a `text/*` content type means the whole body is one text; anything else is
parsed as JSON. OpenAI's `model` and `user` must be strings and are ignored; other unknown JSON
fields are accepted and ignored.

The embedding and tokenize routes take POST. TorchServe passes the handler a request's headers
and body but not its method (and answers OPTIONS itself), so where the adapter cannot say the
method, a request with neither a body nor a content type, which is what a GET sends, is answered
405; a body sent with another method is served as if POSTed.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

import numpy as np
import orjson

from embedserve.handler.api.errors import RequestError, empty, malformed, method_not_allowed, not_found
from embedserve.handler.api.quantize import OUTPUT_DTYPES

ENCODING_FORMATS = ("float", "base64")
TRUNCATION_DIRECTIONS = ("right", "left")

# Every option of a request body, parsed alike on every route: its JSON type and, for a string,
# its values (the first is the default; none listed: any string). A missing field or null means
# the default. The OpenAPI document (openapi.py) is built from this table.
OPTION_TYPES: dict[str, tuple[type, tuple[str, ...]]] = {
    "normalize": (bool, ()),
    "truncate": (bool, ()),
    "truncation_direction": (str, TRUNCATION_DIRECTIONS),
    "prompt_name": (str, ()),
    "dimensions": (int, ()),  # a positive integer
    "output_dtype": (str, OUTPUT_DTYPES),
    "encoding_format": (str, ENCODING_FORMATS),
    "add_special_tokens": (bool, ()),  # /tokenize only
}
# Options whose values are matched in any case: TEI clients send "Left" and "Right".
CASE_INSENSITIVE = ("truncation_direction",)
# OpenAI's request fields the URL makes needless: checked to be strings, then ignored.
IGNORED_FIELDS = ("model", "user")

# The method the embedding and tokenize routes take; /info and openapi.json take any.
ALLOWED_METHOD = "POST"

# One input: a text, or pre-tokenized ids (OpenAI's token-array input).
Input = Union[str, tuple[int, ...]]


class Route(Enum):
    NATIVE = ""
    OPENAI = "v1/embeddings"
    TEI_EMBED = "embed"
    TEI_SIMILARITY = "similarity"
    TEI_TOKENIZE = "tokenize"
    TEI_INFO = "info"
    OPENAPI = "openapi.json"
    TEI_RERANK = "rerank"
    TEI_PREDICT = "predict"
    RERANK_V1 = "v1/rerank"
    RERANK_V2 = "v2/rerank"

    @property
    def tei(self) -> bool:
        return self in _TEI_ROUTES

    @property
    def scoring(self) -> bool:
        """A reranker's or classifier's route: scores, not vectors."""
        return self in SCORING_ROUTES

    @property
    def any_method(self) -> bool:
        """Routes that describe the server: any method, any body."""
        return self in (Route.TEI_INFO, Route.OPENAPI)


_TEI_ROUTES = frozenset((Route.TEI_EMBED, Route.TEI_SIMILARITY, Route.TEI_TOKENIZE, Route.TEI_INFO, Route.TEI_RERANK,
                         Route.TEI_PREDICT))
SCORING_ROUTES = (Route.TEI_RERANK, Route.RERANK_V1, Route.RERANK_V2, Route.TEI_PREDICT)
EMBEDDING_ROUTES = (Route.NATIVE, Route.OPENAI, Route.TEI_EMBED, Route.TEI_SIMILARITY)
_ROUTES = {route.value: route for route in Route}


@dataclass(frozen=True)
class Options:
    # None means the server's setting.
    normalize: bool | None = None
    truncate: bool | None = None
    truncation_direction: str = "right"
    prompt_name: str | None = None
    dimensions: int | None = None  # Matryoshka truncation
    output_dtype: str = "float"
    encoding_format: str = "float"
    add_special_tokens: bool = True  # /tokenize only


@dataclass(frozen=True)
class EmbeddingRequest:
    route: Route
    inputs: tuple[Input, ...] = ()
    options: Options = field(default_factory=Options)
    # The JSON field the inputs came from, to name it in errors ("input" or "inputs").
    field: str = "input"

    def param(self, index: int) -> str:
        """Input `index`'s place in the body, for errors: /similarity's input 0 is its source."""
        if self.route is Route.TEI_SIMILARITY:
            return "inputs.source_sentence" if index == 0 else f"inputs.sentences[{index - 1}]"
        return f"{self.field}[{index}]"


def parse_route(url_path: str | None) -> Route:
    path = (url_path or "").strip("/")
    route = _ROUTES.get(path)
    if route is not None:
        return route
    known = ", ".join(f"'{r.value}'" for r in Route)
    raise not_found(f"unknown route '{path}' after /predictions/<model>/<version>/; known: {known}")


def parse_request(body: Any, content_type: str | None, url_path: str | None,
                  method: str | None = None) -> EmbeddingRequest:
    """Decode and validate one request's shape; raise RequestError naming the faulty field.
    `method`: the HTTP method, None where the server does not say (TorchServe)."""
    route = parse_route(url_path)
    try:
        if route.any_method:
            return EmbeddingRequest(route)
        check_method(method, body, content_type)
        payload = decode_body(body, content_type)
        if isinstance(payload, str) and is_text(content_type):
            return EmbeddingRequest(route, (check_text(payload, "body"),), field="body")
        if not isinstance(payload, dict):  # a JSON string is not a text/plain body
            raise malformed("request body must be a JSON object", param="body")
        if route is Route.NATIVE and "input" not in payload and "inputs" in payload:
            route = Route.TEI_EMBED  # Hugging Face clients post TEI bodies to the bare model URL
        name = "inputs" if route.tei else "input"
        if name not in payload:
            raise malformed(f"missing required field '{name}'", param=name)
        if route is Route.TEI_SIMILARITY:
            return _similarity_request(payload)
        inputs = _parse_inputs(payload[name], name, allow_token_ids=not route.tei)
        return EmbeddingRequest(route, inputs, _parse_options(payload), field=name)
    except RequestError as err:
        err.tei = route.tei
        raise


def _similarity_request(payload: dict[str, Any]) -> EmbeddingRequest:
    """TEI's /similarity: the source sentence is input 0, the sentences follow. Its answer is
    cosines, so options that change the vectors' encoding do not apply."""
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
    inputs = (source, *_parse_inputs(sentences, "inputs.sentences", allow_token_ids=False))
    options = _parse_options(payload)
    for key in ("output_dtype", "encoding_format"):
        if getattr(options, key) != OPTION_TYPES[key][1][0]:
            raise malformed(f"'{key}' does not apply to /similarity, which answers cosines", param=key)
    return EmbeddingRequest(Route.TEI_SIMILARITY, inputs, options, field="inputs.sentences")


def check_method(method: str | None, body: Any, content_type: str | None) -> None:
    """405 for a method other than POST; where the method is unknown, for a request with neither
    a body nor a content type: a GET (a POST without a body is refused either way)."""
    if method is not None:
        if method.upper() != ALLOWED_METHOD:
            raise method_not_allowed(f"method {method.upper()} is not allowed on this route; "
                                     f"it takes {ALLOWED_METHOD} with a JSON body")
        return
    if isinstance(body, (bytes, bytearray, str)) and not body and not content_type:
        raise method_not_allowed(
            f"this route takes {ALLOWED_METHOD} with a JSON body; the request came with neither a body nor "
            "a content type, as a GET does (the server does not pass the method on, so a request of any "
            "method without a body is answered this way)")


def decode_body(body: Any, content_type: str | None) -> Any:
    """Return a str for a text/* body, else the parsed JSON value."""
    if body is None:
        # TorchServe turns a form-encoded body (curl -d without a content type) into form
        # fields, leaving no body; say how to send it instead.
        raise malformed(
            "request body is empty or form-encoded; send JSON with 'Content-Type: application/json', "
            "or one text with 'Content-Type: text/plain'",
            param="body",
        )
    if isinstance(body, (dict, list)):  # TorchServe already parsed the JSON
        return _without_surrogates(body)
    if isinstance(body, (bytes, bytearray)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as err:
            raise malformed(f"request body is not valid UTF-8 (byte {err.start})", param="body") from None
    if not isinstance(body, str):
        raise malformed("request body has an unsupported type", param="body")
    if is_text(content_type):
        return body
    try:
        return _without_surrogates(json.loads(body))
    except json.JSONDecodeError as err:
        raise malformed(
            f"request body is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
            "send application/json, or text/plain for a single text",
            param="body",
        ) from None
    except RecursionError:
        raise malformed("request body is nested too deeply", param="body") from None
    except ValueError as err:  # an integer of more digits than Python converts (4300)
        raise malformed(f"request body is not valid JSON here ({err})", param="body") from None


def is_text(content_type: str | None) -> bool:
    """A text/* body is one text, whatever it holds."""
    return (content_type or "").lower().startswith("text/")


def _without_surrogates(value: Any) -> Any:
    """JSON may escape unpaired UTF-16 surrogates ("\\ud800"), which are not text: no tokenizer or
    encoder takes them. Refuse them, naming where, instead of failing later."""
    try:
        orjson.dumps(value)  # in C: refuses a surrogate anywhere, keys included
        return value
    except TypeError:  # a surrogate, or what orjson cannot write (a huge int, deep nesting): look closer
        pass
    stack = [(value, "body")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise malformed(f"'{path}' holds an unpaired UTF-16 surrogate at character {err.start}, "
                                "which is not valid Unicode text", param=path) from None
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, path))
                stack.append((child, key if path == "body" else f"{path}.{key}"))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return value


def _parse_inputs(value: Any, name: str, allow_token_ids: bool) -> tuple[Input, ...]:
    kinds = "a string or a list of strings" + (", or token ids" if allow_token_ids else "")
    if isinstance(value, str):
        return (check_text(value, name),)
    if not isinstance(value, list):
        raise malformed(f"'{name}' must be {kinds}, got {json_type(value)}", param=name)
    if not value:
        raise empty(f"'{name}' must not be an empty list", param=name)
    if allow_token_ids and _is_int(value[0]):  # one pre-tokenized input: [101, 2023, ...]
        return (_check_ids(value, name),)
    parsed: list[Input] = []
    for i, item in enumerate(value):
        param = f"{name}[{i}]"
        if isinstance(item, str):
            parsed.append(check_text(item, param))
        elif allow_token_ids and isinstance(item, list):
            parsed.append(_check_ids(item, param))
        else:
            expected = "a string" + (" or a list of token ids" if allow_token_ids else "")
            raise malformed(f"'{param}' must be {expected}, got {json_type(item)}", param=param)
    return tuple(parsed)


def check_text(text: str, param: str) -> str:
    if not text:
        raise empty(f"'{param}' must not be an empty string", param=param)
    return text


def _check_ids(ids: list, param: str) -> tuple[int, ...]:
    if not ids:
        raise empty(f"'{param}' must not be an empty list of token ids", param=param)
    for j, token in enumerate(ids):
        if not _is_int(token) or token < 0:
            raise malformed(f"'{param}[{j}]' must be a non-negative integer token id, got {_short(token)}",
                            param=f"{param}[{j}]")
    return tuple(ids)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_options(payload: dict[str, Any]) -> Options:
    for key in IGNORED_FIELDS:
        option_value(payload, key, str, ())
    values = {key: option_value(payload, key, kind, choices) for key, (kind, choices) in OPTION_TYPES.items()}
    return Options(**{key: value for key, value in values.items() if value is not None})


def option_value(payload: dict, key: str, kind: type, choices: tuple[str, ...]) -> Any:
    """The option's value, None where it is missing or null; refuses a wrong type or value."""
    value = payload.get(key)
    if value is None:
        return None
    if kind is bool and not isinstance(value, bool):
        raise malformed(f"'{key}' must be true or false, got {json_type(value)}", param=key)
    if kind is int and (not _is_int(value) or value < 1):
        raise malformed(f"'{key}' must be a positive integer, got {json_type(value)} {_short(value)}", param=key)
    if kind is str and not isinstance(value, str):
        raise malformed(f"'{key}' must be a string, got {json_type(value)}", param=key)
    if choices:
        normalized = value.lower() if key in CASE_INSENSITIVE else value
        if normalized not in choices:
            raise malformed(f"'{key}' must be one of {', '.join(choices)}, got {_short(value)}", param=key)
        return normalized
    return value


def _short(value: Any) -> str:
    """A value for a message: its repr, cut short (a 4000-digit number, a long string)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


# --- responses -------------------------------------------------------------------------------

# The most bytes one number takes in a JSON answer, its separator included: orjson writes a
# float32 in at most 16 characters ("-0.0000053924714"), an int8 code in 4 ("-128").
_FLOAT_JSON_BYTES = 17
_CODE_JSON_BYTES = 5
# Bytes around each vector ({"object":"embedding","index":4095,"embedding":...},) and around the
# list (object, model, usage), with room to spare.
_ROW_OVERHEAD_BYTES = 64
_LIST_OVERHEAD_BYTES = 256


def max_answer_bytes(count: int, dimensions: int, output_dtype: str, encoding_format: str,
                     model_name: str = "", route: Route | None = None) -> int:
    """An upper bound of the bytes an embedding answer of `count` vectors takes on `route` (None:
    any route), computed before embedding: what must fit TorchServe's max_response_size."""
    values = -(-dimensions // 8) if output_dtype in ("binary", "ubinary") else dimensions
    if encoding_format == "base64":
        row = 4 * -(-values * _base64_value_bytes(output_dtype, route) // 3)
    else:
        row = values * (_FLOAT_JSON_BYTES if output_dtype == "float" else _CODE_JSON_BYTES)
    return count * (row + _ROW_OVERHEAD_BYTES) + _LIST_OVERHEAD_BYTES + len(model_name)


def _base64_value_bytes(output_dtype: str, route: Route | None) -> int:
    """Bytes one value takes before base64: 4 (float32) for floats, and for codes on the OpenAI
    route, whose clients decode base64 as float32 whatever was asked; 1 for codes elsewhere."""
    return 4 if output_dtype == "float" or route in (None, Route.OPENAI) else 1


def encode_embeddings(request: EmbeddingRequest, vectors: np.ndarray, *, model_name: str, prompt_tokens: int) -> bytes:
    """(n, d) vectors, already in the requested output dtype, in the route's shape; /similarity's
    cosines of each sentence to the source (input 0)."""
    if request.route is Route.TEI_SIMILARITY:
        vectors = vectors.astype(np.float64)
        norms = np.linalg.norm(vectors, axis=1).clip(min=1e-12)
        return dumps((vectors[1:] @ vectors[0] / norms[1:] / norms[0]).astype(np.float32))
    rows = [_encode_vector(row, request.options.encoding_format, request.route) for row in vectors]
    if request.route.tei:
        return dumps(rows)
    return dumps({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)],
        "model": model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })


def _encode_vector(row: np.ndarray, encoding_format: str, route: Route) -> np.ndarray | str:
    if encoding_format == "base64":
        # Floats are OpenAI's encoding: little-endian float32 bytes. Codes go the same way on the
        # OpenAI route, because OpenAI clients (the official one asks for base64 by default)
        # decode every base64 embedding as float32; on the other routes they go compact, one
        # byte a code, to callers that asked for base64 knowing the dtype.
        compact = row.dtype.kind != "f" and route is not Route.OPENAI
        data = row if compact else row.astype("<f4")
        return base64.b64encode(data.tobytes()).decode("ascii")
    return np.ascontiguousarray(row)  # serialized by orjson straight from the array


def encode_tokens(tokens: list[list[dict[str, Any]]]) -> bytes:
    return dumps(tokens)


def encode_info(info: dict[str, Any]) -> bytes:
    return dumps(info)


def encode_error(error: RequestError) -> bytes:
    return dumps(error.body())


def dumps(value: Any) -> bytes:
    # orjson writes numpy arrays directly, float32 in its shortest round-trip form: about 20x
    # faster than json + tolist() and half the bytes per embedding.
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
