"""The JSON every route reads and writes: bodies decoded with exact error paths, values checked by
type, answers written by orjson. Plain Python + numpy, no torch and no server.

The route families (embedserve/handler/routes/) read their own fields with these pieces; the
tasks (embedserve/handler/tasks/) own the request types they fill.

Body decoding: a `text/*` content type means the whole body is one text; anything else is parsed
as JSON. A JSON number with an integral value (`60.0`) is an integer, as JSON Schema counts it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from embedserve.handler.api.errors import RequestError, empty, malformed, method_not_allowed

# The method every route but the describing ones (info, openapi.json, docs) takes.
ALLOWED_METHOD = "POST"


def check_method(method: str | None) -> None:
    """405 for a method other than POST; None: the server does not say, so the request is served."""
    if method is not None and method.upper() != ALLOWED_METHOD:
        raise method_not_allowed(f"method {method.upper()} is not allowed on this route; it takes "
                                 f"{ALLOWED_METHOD} with a JSON body")


def decode_body(body: Any, content_type: str | None) -> Any:
    """Return a str for a text/* body, else the parsed JSON value."""
    if body is None:
        # A form-encoded body (curl -d without a content type) may reach the handler as form
        # fields, leaving no body; say how to send it instead.
        raise malformed(
            "request body is empty or form-encoded; send JSON with 'Content-Type: application/json', "
            "or one text with 'Content-Type: text/plain'",
            param="body",
        )
    if isinstance(body, (dict, list)):  # the server already parsed the JSON
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


def json_object(body: Any, content_type: str | None, method: str | None) -> dict[str, Any]:
    """A POSTed body that must be a JSON object."""
    check_method(method)
    payload = decode_body(body, content_type)
    if not isinstance(payload, dict):
        raise malformed("request body must be a JSON object", param="body")
    return payload


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


def required(payload: dict[str, Any], key: str) -> Any:
    if payload.get(key) is None:
        raise malformed(f"missing required field '{key}'", param=key)
    return payload[key]


def as_int(value: Any) -> int | None:
    """`value` as an integer: an int, or a float of integral value (JSON Schema's integer, what
    Python's json.dumps writes for 256.0); None for anything else, booleans included."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def option_value(payload: dict, key: str, kind: type, choices: tuple[str, ...] = (),
                 case_insensitive: bool = False, minimum: int = 1) -> Any:
    """The option's value, None where it is missing or null; refuses a wrong type or value (an
    integer below `minimum`)."""
    value = payload.get(key)
    if value is None:
        return None
    if kind is bool and not isinstance(value, bool):
        raise malformed(f"'{key}' must be true or false, got {json_type(value)}", param=key)
    if kind is int:
        number = as_int(value)
        if number is None or number < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
            raise malformed(f"'{key}' must be {what}, got {json_type(value)} {short(value)}", param=key)
        return number
    if kind is str and not isinstance(value, str):
        raise malformed(f"'{key}' must be a string, got {json_type(value)}", param=key)
    if choices:
        normalized = value.lower() if case_insensitive else value
        if normalized not in choices:
            raise malformed(f"'{key}' must be one of {', '.join(choices)}, got {short(value)}", param=key)
        return normalized
    return value


def short(value: Any) -> str:
    """A value for a message: its repr, cut short (a 4000-digit number, a long string)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def encode_error(error: RequestError) -> bytes:
    return dumps(error.body())


def dumps(value: Any) -> bytes:
    # orjson writes numpy arrays directly, float32 in its shortest round-trip form: about 20x
    # faster than json + tolist() and half the bytes per embedding.
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
