"""What a route family declares for each of its paths, and the reading every embedding route shares.

A family (native.py, openai.py, tei.py, cohere.py) declares RouteSpecs: the path, the tasks it
serves (none: it describes the server, for any task), how a body becomes the task's request, and
how the task's result becomes the answer's bytes. routes/table.py gathers them; the service looks
a request's route up there, once to parse and once to encode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from embedserve.handler.api.codec import check_method, decode_body, encode_error, is_text, option_value
from embedserve.handler.api.errors import RequestError, malformed
from embedserve.handler.api.route import Route
from embedserve.handler.inputs.items import has_objects, read_items
from embedserve.handler.inputs.text import read_inputs, read_text
from embedserve.handler.model.description import Task
from embedserve.handler.tasks.embed import IGNORED_FIELDS, EmbeddingRequest, parse_options

# (body, content type, method) -> the task's request; raises RequestError naming the field.
Parse = Callable[[Any, "str | None", "str | None"], Any]
# (request, result, model name) -> the answer's bytes.
Encode = Callable[[Any, Any, str], bytes]


@dataclass(frozen=True)
class RouteSpec:
    route: Route
    tasks: frozenset[Task]  # the tasks whose models serve it; empty: every model (it describes the server)
    parse: Parse
    encode: Encode | None = None  # None: the service answers it itself (info, openapi.json, docs)
    # The OpenAPI operations of its path ({"post": ...}), given the served model (routes/schema.py).
    operations: Callable[[Any], dict[str, Any]] | None = None


def parsing(route: Route, parse: Callable[..., Any]) -> Parse:
    """`parse` with errors in `route`'s shape (TEI's or OpenAI's)."""
    def parse_in_shape(body: Any, content_type: str | None, method: str | None) -> Any:
        try:
            return parse(body, content_type, method)
        except RequestError as err:
            err.tei = route.tei
            raise
    return parse_in_shape


def embedding_request(route: Route, body: Any, content_type: str | None, method: str | None, *,
                      allow_token_ids: bool, tei_body: bool = False,
                      extend: Callable[[EmbeddingRequest, dict[str, Any]], Any] | None = None) -> Any:
    """An embedding route's body: one text (a text/* body), or a JSON object with the inputs under
    `input` (`inputs` on TEI's routes) and the options. `tei_body`: a body with `inputs` and no
    `input` is TEI's /embed (Hugging Face clients post TEI bodies to the bare model URL). Errors
    come in the shape of the route the body turned out to be for. `extend` reads what a task adds
    to the request from the JSON body (a text/plain body: from an empty one)."""
    try:
        check_method(method)
        payload = decode_body(body, content_type)
        if isinstance(payload, str) and is_text(content_type):
            request = EmbeddingRequest(route, (read_text(payload, "body"),), field="body")
            return extend(request, {}) if extend else request
        if not isinstance(payload, dict):  # a JSON string is not a text/plain body
            raise malformed("request body must be a JSON object", param="body")
        if tei_body and "input" not in payload and "inputs" in payload:
            route, allow_token_ids = Route.TEI_EMBED, False
        name = "inputs" if route.tei else "input"
        if name not in payload:
            raise malformed(f"missing required field '{name}'", param=name)
        request = EmbeddingRequest(route, _inputs(route, payload, name, allow_token_ids), parse_options(payload),
                                   field=name)
        return extend(request, payload) if extend else request
    except RequestError as err:
        err.tei = route.tei
        raise


def _inputs(route: Route, payload: dict[str, Any], name: str, allow_token_ids: bool) -> tuple:
    """The inputs under `name`: on the native and OpenAI routes, item objects too (Jina's: a text or
    an image each, inputs/items.py), which say their kind themselves, so `modality` goes without them."""
    if route not in (Route.NATIVE, Route.OPENAI):
        return read_inputs(payload[name], name, allow_token_ids=allow_token_ids)
    if has_objects(payload[name]) and payload.get("modality") is not None:
        raise malformed(f"'modality' applies to plain string inputs; the item objects of '{name}' say their kind "
                        "themselves ({\"text\": ...} or {\"image\": ...}): leave 'modality' out", param="modality")
    return read_items(payload[name], name, allow_token_ids)


def texts_body(route: Route, body: Any, content_type: str | None, method: str | None
               ) -> tuple[dict[str, Any], tuple, str]:
    """A route whose inputs are texts alone: one text as a text/plain body (not on TEI's routes),
    or a JSON object with them under `input` (`inputs` on TEI's routes), OpenAI's `model` and
    `user` checked to be strings. The payload (empty for a text/plain body), the texts, their field."""
    check_method(method)
    payload = decode_body(body, content_type)
    if isinstance(payload, str) and is_text(content_type) and not route.tei:
        return {}, (read_text(payload, "body"),), "body"
    if not isinstance(payload, dict):
        raise malformed("request body must be a JSON object", param="body")
    name = "inputs" if route.tei else "input"
    if name not in payload:
        raise malformed(f"missing required field '{name}'", param=name)
    for key in IGNORED_FIELDS:
        option_value(payload, key, str)
    return payload, read_inputs(payload[name], name, allow_token_ids=False), name


def describing(route: Route, operations: Callable[[Any], dict[str, Any]] | None = None) -> RouteSpec:
    """A route that describes the server (any method, any body), answered by the service."""
    return RouteSpec(route, frozenset(), lambda body, content_type, method: EmbeddingRequest(route),
                     operations=operations)


def error_body(err: RequestError, route: Route) -> tuple[int, bytes]:
    err.tei = route.tei  # TEI routes answer in TEI's shape and statuses
    return err.http_status, encode_error(err)
