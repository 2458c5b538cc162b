"""The pieces of the OpenAPI document every route family uses: the served model's facts, an
operation with its error responses (each status in the route's own shape, with real error bodies
made by the route's own parse), option schemas from the embed task's option table, and the
schemas every route shares. Each family declares its own operations and schemas with these
(routes/native.py, openai.py, tei.py, cohere.py); routes/openapi.py assembles the document.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from embedserve.handler.api.codec import ALLOWED_METHOD
from embedserve.handler.api.errors import (EMPTY, INTERNAL, KINDS, MALFORMED, METHOD_NOT_ALLOWED, OUT_OF_MEMORY,
                                           OVERLOADED, TOO_LARGE, UNAVAILABLE, UNPROCESSABLE, ErrorKind, RequestError,
                                           too_large)
from embedserve.handler.api.quantize import SCALAR_DTYPES
from embedserve.handler.api.route import Route
from embedserve.handler.api.server import PLAIN, ServerProfile
from embedserve.handler.model.description import Task
from embedserve.handler.settings import Settings
from embedserve.handler.inputs.image import MEDIA_TYPES, ImageLimits
from embedserve.handler.tasks.embed import CASE_INSENSITIVE, INT_MINIMUMS, MODALITIES, OPTION_TYPES, Options

@dataclass(frozen=True)
class ServedModel:
    """What the document says about one served model."""
    name: str
    version: str
    dimension: int
    max_length: int  # tokens per input
    vocab_size: int
    prompts: tuple[str, ...]  # prompt names
    settings: Settings
    max_tokens_per_request: int  # the setting, or lower where the worker's measured speed asks
    max_chunk_overlap: int = 0  # "chunk_overlap" at most: a window's text room with the longest prompt, less one
    span_pooling: bool = True  # whether its pooling has a vector for a span: late chunking
    reads_images: bool = False  # an image-text model: "modality": "image" embeds images
    task: Task = Task.EMBED
    labels: tuple[str, ...] = ()  # a scoring model's labels
    instructed: bool = False  # a causal reranker: (query, document) pairs only, an instruction allowed
    server: ServerProfile = PLAIN  # its paths, its key, its own answers


def limits(model: ServedModel) -> dict[str, int]:
    """Every limit a request meets, by the name its 413 message (or the option) uses."""
    settings = model.settings
    return {
        "dimension": model.dimension,
        "max_input_length": model.max_length,
        "max_inputs_per_request": settings.max_inputs_per_request,
        "max_input_chars": settings.max_input_chars,
        "max_tokens_per_request": model.max_tokens_per_request,
        "max_response_bytes": settings.max_response_bytes,
    }


# Error kinds each route answers in its own shape; the method check comes before the body is
# read, so a 405 is always in the route's own shape.
EMBED_ERRORS = (MALFORMED, EMPTY, UNPROCESSABLE, METHOD_NOT_ALLOWED, TOO_LARGE, INTERNAL, OVERLOADED, OUT_OF_MEMORY)
TOKENIZE_ERRORS = (MALFORMED, EMPTY, UNPROCESSABLE, METHOD_NOT_ALLOWED, TOO_LARGE, INTERNAL)
DESCRIBE_ERRORS = (INTERNAL,)
BEFORE_BODY = (METHOD_NOT_ALLOWED,)
# What fails a whole batch, in the OpenAI shape on every route (service.failed, service.unavailable).
BATCH_ERRORS = (INTERNAL, UNAVAILABLE)

OPTION_NOTES = {
    "normalize": "L2-normalize the vectors (after `dimensions`)",
    "truncate": "cut inputs over the max input length; false refuses them with 413",
    "truncation_direction": "the side truncation cuts: `right` the end, `left` the start (any case)",
    "prompt_name": "a prompt of the model, tokenized in front of each text and never cut",
    "dimensions": "Matryoshka truncation to the first N dimensions (re-normalized when normalizing)",
    "output_dtype": "float, or quantized codes: int8/uint8 (need normalized vectors), binary/ubinary (1 bit a "
                    "dimension, packed 8 to a byte)",
    "encoding_format": "JSON numbers, or base64: on the OpenAI route little-endian float32 bytes of the values "
                       "whatever the dtype; on the native and TEI routes one byte a code for quantized dtypes",
    "add_special_tokens": "/tokenize: list the model's special tokens too (elsewhere checked, no effect)",
    "long_input": "an input over the max input length: `truncate` cuts it (see `truncate`); `chunk` cuts it into "
                  "windows of that length, embeds each and answers their mean weighted by their text tokens; "
                  "`late_chunk` answers a vector per span (`chunk_size` tokens, or `chunk_spans`), each pooled from "
                  "the token states of its whole input (windows of that length for a longer one), on the OpenAI "
                  "and native routes of models pooling mean or max",
    "chunk_overlap": "with `long_input` chunk: tokens of text each window repeats of the one before; with "
                     "late_chunk: tokens of text before a window's first span it carries as context",
    "chunk_size": "with `long_input` late_chunk: tokens of text a span (default 256, or a window's text where less)",
    "chunk_spans": "with `long_input` late_chunk: for each input, its spans as [start, end) character ranges of the "
                   "text (a span is the tokens those characters touch); replaces `chunk_size`",
    "modality": "what the plain string inputs are: \"text\", or \"image\" (each input an image as a data URI, "
                "data:image/png;base64,..., or a URL of a host image_url_hosts names, for a model that reads "
                "images); item objects ({\"text\": ...}, {\"image\": ...}) say their kind and take no modality",
    "model": "accepted and ignored: the URL names the model",
    "user": "accepted and ignored",
}
# add_special_tokens too: the embedding routes check it (a boolean) though only /tokenize uses it.
EMBED_OPTIONS = tuple(OPTION_TYPES)
TOKENIZE_OPTIONS = ("add_special_tokens", "prompt_name")


def operation(operation_id: str, summary: str, request: dict | None, answer: dict,
               errors: dict[str, Any]) -> dict[str, Any]:
    operation: dict[str, Any] = {"operationId": operation_id, "summary": summary}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": request}
    operation["responses"] = {
        "200": {"description": "the answer", "headers": {
            "x-batch-size": header("how many requests the server batched with this one"),
            "server-timing": header("the handler's time for this request's batch, in ms (W3C Server-Timing): parse, "
                                    "tokenize, model (its CPU threads in desc), encode, and the handler's whole time")},
                "content": {"application/json": answer}},
        **errors,
    }
    return operation


def error_responses(kinds: tuple[ErrorKind, ...], route: Route, server: ServerProfile, *, also_tei: bool = False,
                     model: ServedModel | None = None, parse: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Each status the route answers: when, and the bodies it comes with."""
    answers: dict[int, tuple[list[str], list[str]]] = {}  # status -> (whens, schema names)

    def add(status: int, when: str, schema: str | None) -> None:
        whens, schemas = answers.setdefault(status, ([], []))
        whens.append(when)
        if schema and schema not in schemas:
            schemas.append(schema)

    for kind in kinds:
        add(kind.tei_status if route.tei else kind.status, kind.meaning, "TEIError" if route.tei else "OpenAIError")
        if also_tei and kind not in BEFORE_BODY:
            add(kind.tei_status, f"{kind.meaning} (a TEI body: TEI's shape)", "TEIError")
    for kind in BATCH_ERRORS:
        add(kind.status, f"{kind.meaning} (the whole batch: OpenAI's shape)", "OpenAIError")
    for own in server.answers:
        add(own.status, own.when, own.schema)

    examples = error_examples(route, model, parse) if model is not None and parse is not None else {}
    responses = {}
    for status in sorted(answers):
        whens, schemas = answers[status]
        response: dict[str, Any] = {"description": "; ".join(whens)}
        if schemas:  # else an empty body
            schema = ref(schemas[0]) if len(schemas) == 1 else {"anyOf": [ref(name) for name in schemas]}
            content: dict[str, Any] = {"schema": schema}
            if status in examples:
                content["example"] = examples[status]
            response["content"] = {"application/json": content}
        if status in (429, 503):
            response["headers"] = {"retry-after": header("seconds to wait before retrying")}
        if status == METHOD_NOT_ALLOWED.status:
            response["headers"] = {"allow": header(f"the method the route takes: {ALLOWED_METHOD}")}
        responses[str(status)] = response
    return responses


def header(description: str) -> dict[str, Any]:
    return {"description": description, "schema": {"type": "string"}}


def embedding_examples(model: ServedModel) -> dict[str, Any]:
    examples = {
        "texts": {"input": ["The quick brown fox", "jumps over the lazy dog"]},
        "options": {"model": model.name, "input": "hello", "dimensions": min(64, model.dimension),
                    "encoding_format": "base64", "output_dtype": "int8"},
        "token ids": {"input": [[min(7592, model.vocab_size - 1), min(2088, model.vocab_size - 1)]]},
    }
    if model.prompts:
        examples["prompt"] = {"input": "what is an embedding?", "prompt_name": model.prompts[0]}
    return examples


def examples(values: dict[str, Any]) -> dict[str, Any]:
    return {name.replace(" ", "_"): {"summary": name, "value": value} for name, value in values.items()}


def list_example(model: ServedModel) -> dict[str, Any]:
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.0213, -0.0452, 0.0088]}],
            "model": model.name, "usage": {"prompt_tokens": 4, "total_tokens": 4}}


def error_examples(route: Route, model: ServedModel, parse: Callable[..., Any]) -> dict[int, Any]:
    """Real error bodies, made by the codec from bad requests on this route."""
    field = "inputs" if route.tei else "input"
    bodies = [(b"", None, "GET"), (b'{"%s": ["hello", 5]}' % field.encode(), "application/json", "POST")]
    examples = {}
    for body, content_type, method in bodies:
        try:
            parse(body, content_type, method)
        except RequestError as err:
            examples[err.http_status] = err.body()
    limit = model.settings.max_inputs_per_request
    error = too_large(f"'{field}' has {limit + 1} inputs; the limit is max_inputs_per_request={limit}", param=field)
    error.tei = route.tei
    examples[error.http_status] = error.body()
    return examples


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def openai_error() -> dict[str, Any]:
    kinds = KINDS
    return {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
            "properties": {
                "message": {"type": "string"},
                "type": {"enum": sorted({kind.error_type for kind in kinds})},
                "param": {"type": ["string", "null"], "description": "the field at fault: 'input[2]', 'dimensions'"},
                "code": {"enum": [kind.code for kind in kinds]}}}},
    }


def option_schema(key: str, model: ServedModel) -> dict[str, Any]:
    kind, choices = OPTION_TYPES[key]
    default = getattr(Options(), key)
    if kind is bool:
        schema: dict[str, Any] = {"type": ["boolean", "null"]}
        if default is None:  # the server's setting
            default = getattr(model.settings, key)
    elif kind is int:
        schema = {"type": ["integer", "null"], "minimum": INT_MINIMUMS.get(key, 1)}
    elif kind is list:  # chunk_spans: [start, end] character ranges per input
        schema = {"type": ["array", "null"], "minItems": 1, "maxItems": model.settings.max_inputs_per_request,
                  "items": {"type": "array", "minItems": 1, "items": RANGE}}
    elif key in CASE_INSENSITIVE:
        schema = {"type": ["string", "null"], "pattern": "|".join(f"^{any_case(choice)}$" for choice in choices),
                  "examples": list(choices)}
    elif choices:
        schema = {"enum": [*choices, None]}
    else:
        schema = {"type": ["string", "null"]}
    if key == "dimensions":
        schema["maximum"] = model.dimension
        default = model.dimension
    if key == "chunk_overlap":
        schema["maximum"] = model.max_chunk_overlap
    if key == "chunk_size":
        schema["maximum"] = model.max_chunk_overlap + 1
    if key == "long_input" and model.task is not Task.EMBED:  # one vector an input to combine: dense models only
        schema = {"enum": [choices[0], None]}
    elif key == "long_input" and not model.span_pooling:  # CLS or last-token pooling: no vector for a span
        schema = {"enum": [choice for choice in (*choices, None) if choice != "late_chunk"]}
    if key == "modality" and not model.reads_images:
        schema = {"enum": [choices[0], None]}
    if key == "prompt_name":  # the default: the `prompt` setting, else the model's default prompt
        schema = {"enum": [*model.prompts, None]}
    schema["description"] = OPTION_NOTES[key] + "; missing or null: the default"
    if default is not None:
        schema["default"] = default
    return schema


def any_case(word: str) -> str:
    return "".join(f"[{char.upper()}{char.lower()}]" if char.isalpha() else char for char in word)


def many(model: ServedModel, items: dict[str, Any] | None = None) -> dict[str, Any]:
    """A non-empty list of at most max_inputs_per_request items."""
    return {"type": "array", "minItems": 1, "maxItems": model.settings.max_inputs_per_request,
            **({"items": items} if items is not None else {})}


def options(model: ServedModel) -> dict[str, Any]:
    """The embed task's options, each with its schema."""
    return {key: option_schema(key, model) for key in OPTION_TYPES}


def common_schemas(model: ServedModel) -> dict[str, Any]:
    """The schemas every family's operations refer to."""
    settings, dimension, many_ = model.settings, model.dimension, many(model)
    vector = {"anyOf": [
        {"type": "array", "minItems": 1, "maxItems": dimension, "items": {"type": "number"}},
        {"type": "string", "contentEncoding": "base64"},
    ]}
    return {
        "Text": {"type": "string", "minLength": 1, "maxLength": settings.max_input_chars,
                 "description": f"one text, at most max_input_chars={settings.max_input_chars} characters"},
        "TokenIds": {"type": "array", "minItems": 1,
                     "items": {"type": "integer", "minimum": 0, "maximum": model.vocab_size - 1},
                     "description": "one pre-tokenized input: ids of the model's vocabulary, without special "
                                    "tokens (they are added)"},
        "Input": {"anyOf": [ref("Text"), ref("TokenIds"), {**many_, "items": {"anyOf": [ref("Text"),
                                                                                         ref("TokenIds")]}}],
                  "description": "a text, a list of texts, one list of token ids, or a list of such lists"},
        "TEIInputs": {"anyOf": [ref("Text"), {**many_, "items": ref("Text")}]},
        **(image_schemas(model) if model.reads_images else {}),
        **item_schemas(model),
        "Vector": {**vector, "description": "JSON numbers, or a base64 string (encoding_format)"},
        "Info": {"type": "object", "required": ["model_id", "embedding_dimension", "max_input_length"],
                 "properties": {
                     "model_id": {"type": "string"},
                     "served_model_name": {"const": model.name},
                     "embedding_dimension": {"const": dimension},
                     "max_input_length": {"const": model.max_length},
                     "max_client_batch_size": {"const": settings.max_inputs_per_request},
                     "max_input_chars": {"const": settings.max_input_chars},
                     "max_tokens_per_request": {"type": "integer", "minimum": 1},
                     "max_response_bytes": {"type": "integer", "minimum": 1},
                     "output_dtypes": {"const": list(OPTION_TYPES["output_dtype"][1])},
                     "encoding_formats": {"const": list(OPTION_TYPES["encoding_format"][1])},
                     "modalities": {"const": list(MODALITIES) if model.reads_images else [MODALITIES[0]]}}},
        "OpenAPIDocument": {"type": "object", "required": ["openapi", "info", "paths"]},
        "OpenAIError": openai_error(),
        "TEIError": {
            "type": "object", "required": ["error", "error_type"], "additionalProperties": False,
            "properties": {"error": {"type": "string"},
                           "error_type": {"enum": sorted({kind.tei_type for kind in KINDS})}}},
        **model.server.error_schemas,
    }


def scoring_option_schemas(model: ServedModel) -> dict[str, Any]:
    """The options every scoring route takes."""
    option = options(model)
    return {"raw_scores": {"type": ["boolean", "null"], "description": "the logits, without the activation"},
            "truncate": option["truncate"], "truncation_direction": option["truncation_direction"]}


# A [start, end) range: late chunking's caller spans, and its answer's token and character ranges.
RANGE = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "maxItems": 2}
# Caller spans are late chunking's (tasks/embed.py refuses them otherwise).
SPANS_NEED_LATE_CHUNKING = {"if": {"required": ["chunk_spans"], "properties": {"chunk_spans": {"type": "array"}}},
                            "then": {"required": ["long_input"], "properties": {"long_input": {"const": "late_chunk"}}}}


def one_vector_an_input(option: dict[str, Any]) -> dict[str, Any]:
    """The options of a route that answers a vector per input (TEI's): no late chunking, texts only."""
    long_input = {**option["long_input"], "enum": [value for value in option["long_input"]["enum"]
                                                   if value != "late_chunk"]}
    return {**option, "long_input": long_input, "modality": texts_only(option["modality"]),
            "chunk_spans": {"type": "null", "description": "late chunking's: not on this route"}}


def texts_only(modality: dict[str, Any]) -> dict[str, Any]:
    """`modality` where a route takes texts alone (TEI's routes, /tokenize)."""
    return {**modality, "enum": [MODALITIES[0], None], "description": "texts only on this route"}


def image_schemas(model: ServedModel) -> dict[str, Any]:
    """An image item (inputs/image.py reads its form; what its bytes hold no schema can say) and
    the inputs of an image request, for a model that reads images."""
    limits, hosts = ImageLimits.of(model.settings), model.settings.image_url_hosts
    media = "|".join(any_case(media_type) for media_type in MEDIA_TYPES)
    data_uri = f"{any_case('data:')}({media})(;[^;,]*)*;{any_case('base64')},."
    urls = (f"or an http(s) URL of a host image_url_hosts names ({', '.join(hosts)})" if hosts else
            "the server fetches no URL (image_url_hosts names no host)")
    url = url_pattern(hosts)
    image = {"type": "string", "pattern": f"^({data_uri}|{url})" if hosts else f"^{data_uri}",
             "description": f"an image as a data URI (data:image/png;base64,...) of {', '.join(MEDIA_TYPES)}, at "
                            f"most max_image_bytes={limits.max_image_bytes} bytes and max_image_pixels="
                            f"{limits.max_image_pixels} pixels; {urls}"}
    return {"Image": image,
            "ImageInputs": {"anyOf": [ref("Image"), {**many(model), "maxItems": most_images(model),
                                                     "items": ref("Image")}],
                            "description": "with \"modality\": \"image\": an image, or a list of images"},
            "ImageObject": {"anyOf": [_one_key("image", {"anyOf": [ref("Image"), BASE64]}), _one_key("bytes", BASE64),
                                      *([_one_key("url", {"type": "string", "pattern": f"^{url}"})] if hosts else [])],
                            "description": f"Jina's image item: {{\"image\": a data URI, base64 of the file, or a "
                                           f"URL}}, or {{\"bytes\": base64}}, {{\"url\": ...}}; at most "
                                           f"max_images_per_request={limits.max_images_per_request} a request"}}


def most_images(model: ServedModel) -> int:
    """Images a request may hold: max_images_per_request, within max_inputs_per_request."""
    return min(model.settings.max_images_per_request, model.settings.max_inputs_per_request)


# A TCP port, 1 to 65535.
PORT = "([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"


def url_pattern(hosts: tuple[str, ...]) -> str:
    """An http(s) URL of one of `hosts` (inputs/image_urls.py matches them so: a host alone allows any
    port), up to its path."""
    named = []
    for host in hosts:
        name, colon, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
        named.append(any_case(re.escape(name)) + (f":{port}" if colon else f"(:{PORT})?"))
    return f"{any_case('http')}[Ss]?://({'|'.join(named)})([/?#]|$)"


BASE64 = {"type": "string", "minLength": 1, "pattern": "^[A-Za-z0-9+/]+=*$", "description": "an image file in base64"}


def _one_key(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": [key], "additionalProperties": False, "properties": {key: value}}


def item_schemas(model: ServedModel) -> dict[str, Any]:
    """Inputs as Jina's item objects (inputs/items.py): a text each, or an image for a model that reads
    them, beside plain texts and token ids; the objects say their kind, so `modality` goes without them."""
    objects = [_one_key("text", ref("Text")), *([ref("ImageObject")] if model.reads_images else [])]
    items = {**many(model), "items": {"anyOf": [ref("Text"), ref("TokenIds"), *objects]}, "contains": {"type": "object"}}
    if model.reads_images:
        items["allOf"] = [{"contains": ref("ImageObject"), "minContains": 0, "maxContains": most_images(model)}]
    return {"ItemInputs": {**items, "description": "a list of inputs of which some are item objects: {\"text\": ...}"
                                                   + (" or an image" if model.reads_images else "")}}


# Item objects say their kind themselves: a request of them leaves out `modality`.
OBJECTS_TAKE_NO_MODALITY = {"if": {"required": ["input"], "properties": {"input": {"type": "array",
                                                                                   "contains": {"type": "object"}}}},
                            "then": {"properties": {"modality": {"type": "null"}}}}


def images_need_data_uris(model: ServedModel) -> dict[str, Any]:
    """With "modality": "image", the inputs are images and the text options are left out; else texts."""
    if not model.reads_images:
        return {}
    return {"if": {"required": ["modality"], "properties": {"modality": {"const": "image"}}},
            "then": {"properties": {"input": ref("ImageInputs"), "prompt_name": {"type": "null"},
                                    "long_input": {"enum": [OPTION_TYPES["long_input"][1][0], None]}}},
            "else": {"properties": {"input": {"anyOf": [ref("Input"), ref("ItemInputs")]}}}}


def quantizing_needs_normalizing(model: ServedModel) -> dict[str, Any]:
    """int8 and uint8 quantize unit vectors: refused with "normalize": false, and where the server
    does not normalize by default, without "normalize": true (tasks/embed.py)."""
    normalized = {"const": True} if not model.settings.normalize else {"not": {"const": False}}
    return {"if": {"required": ["output_dtype"], "properties": {"output_dtype": {"enum": list(SCALAR_DTYPES)}}},
            "then": {"properties": {"normalize": normalized},
                     **({} if model.settings.normalize else {"required": ["normalize"]})}}
