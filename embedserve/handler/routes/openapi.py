"""The OpenAPI 3.1 document of the routes a worker serves, built from the code's own definitions.

Routes from the codec's `Route`, request options from its option table (`OPTION_TYPES`), error
statuses and bodies from the error kinds (errors.py), limits from the settings and the worker's
measured bound, the dimension, max length, vocabulary and prompts from the model: nothing is
written twice, so the document cannot drift from what the handler does. The service serves it at
<model>/<version>/openapi.json; docs/api.md is the same facts for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embedserve.handler.api.codec import ALLOWED_METHOD
from embedserve.handler.api.errors import (EMPTY, INTERNAL, KINDS, MALFORMED, METHOD_NOT_ALLOWED, OUT_OF_MEMORY,
                                           OVERLOADED, TOO_LARGE, UNAVAILABLE, UNPROCESSABLE, ErrorKind, RequestError,
                                           too_large)
from embedserve.handler.api.route import Route
from embedserve.handler.api.server import PLAIN, ServerProfile
from embedserve.handler.model.description import Task
from embedserve.handler.routes.table import ROUTES
from embedserve.handler.settings import Settings
from embedserve.handler.tasks.embed import CASE_INSENSITIVE, IGNORED_FIELDS, OPTION_TYPES, Options


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
    "add_special_tokens": "list the model's special tokens too",
    "model": "accepted and ignored: the URL names the model",
    "user": "accepted and ignored",
}
EMBED_OPTIONS = tuple(key for key in OPTION_TYPES if key != "add_special_tokens")
TOKENIZE_OPTIONS = ("add_special_tokens", "prompt_name")


def service_document(service: Any, server: ServerProfile, version: str) -> dict[str, Any]:
    """The document of a service's routes, with its model's real values and limits."""
    text = service.text
    return openapi_document(ServedModel(
        name=service.model_name, version=version, dimension=text.checks.dimension, max_length=text.max_length,
        vocab_size=text.tokenizer.vocab_size, prompts=tuple(sorted(text.prompts)), settings=service.settings,
        max_tokens_per_request=service.max_request_tokens, task=service.task,
        labels=getattr(service.work, "labels", ()), instructed=getattr(service.work, "chat_pairs", None) is not None,
        server=server))


def openapi_document(model: ServedModel) -> dict[str, Any]:
    server = model.server
    base = server.model_url(model.name)
    versioned = server.versioned_url(model.name, model.version)
    bound = limits(model)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"embedserve: {model.name}",
            "version": model.version,
            "description": (
                f"Text embeddings of the model `{model.name}` (dimension {model.dimension}, at most "
                f"{model.max_length} tokens an input) on {server.name}. Every call sends {server.auth}. "
                "Limits: " + ", ".join(f"{key} {value}" for key, value in bound.items()) +
                ". Any other path after the version answers 404 (`not_found`)." +
                (f" {server.note}" if server.note else "")),
            "x-limits": bound,
        },
        "security": [{"bearerAuth": []}],
        "paths": {
            **(_embedding_paths(model, base, versioned) if model.task is Task.EMBED else
               _scoring_paths(model, versioned)),
            f"{versioned}/{Route.TEI_TOKENIZE.value}": {"post": _tokenize(model)},
            f"{versioned}/{Route.TEI_INFO.value}": {"get": _info("infoGet", server), "post": _info("infoPost", server)},
            f"{versioned}/{Route.OPENAPI.value}": {"get": _openapi(server)},
            f"{versioned}/{Route.DOCS.value}": {"get": _docs(server)},
        },
        "components": {
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": server.auth}},
            "schemas": _schemas(model),
        },
    }


# --- operations ------------------------------------------------------------------------------------

def _embedding_paths(model: ServedModel, base: str, versioned: str) -> dict[str, Any]:
    return {base: {"post": _native(model)},
            f"{versioned}/{Route.OPENAI.value}": {"post": _openai(model)},
            f"{versioned}/{Route.TEI_EMBED.value}": {"post": _tei_embed(model)},
            f"{versioned}/{Route.TEI_SIMILARITY.value}": {"post": _tei_similarity(model)}}


def _scoring_paths(model: ServedModel, versioned: str) -> dict[str, Any]:
    """A reranker's routes (TEI's, Cohere's and Jina's rerank, TEI's predict), or a classifier's
    (predict); the others answer 404 naming these (api/scoring.py)."""
    predict = _operation(
        "teiPredict", "Scores per label of a text or a (text, text) pair, TEI's /predict, best first",
        {"application/json": {"schema": _ref("PredictRequest"),
                              "examples": _examples({"pair": {"inputs": ["what is a cat", "a small animal"]}})}},
        {"schema": _ref("PredictAnswer")}, _error_responses(EMBED_ERRORS, Route.TEI_PREDICT, model.server, model=model))
    paths = {f"{versioned}/{Route.TEI_PREDICT.value}": {"post": predict}}
    if model.task is not Task.RERANK:
        return paths
    example = {"query": "what is a cat", "texts": ["a small animal", "a car"]}
    paths[f"{versioned}/{Route.TEI_RERANK.value}"] = {"post": _operation(
        "teiRerank", "Relevance of each text to the query, TEI's /rerank, best first",
        {"application/json": {"schema": _ref("RerankRequest"), "examples": _examples({"texts": example})}},
        {"schema": _ref("RerankAnswer")}, _error_responses(EMBED_ERRORS, Route.TEI_RERANK, model.server, model=model))}
    for route, operation_id in ((Route.RERANK_V1, "rerankV1"), (Route.RERANK_V2, "rerankV2")):
        paths[f"{versioned}/{route.value}"] = {"post": _operation(
            operation_id, "Relevance of each document to the query, Cohere's and Jina's rerank, best first",
            {"application/json": {"schema": _ref("CohereRerankRequest"), "examples": _examples(
                {"documents": {"query": "what is a cat", "documents": ["a small animal", "a car"], "top_n": 1}})}},
            {"schema": _ref("CohereRerankAnswer")}, _error_responses(EMBED_ERRORS, route, model.server, model=model))}
    return paths

def _native(model: ServedModel) -> dict[str, Any]:
    tei_body = {"allOf": [_ref("TEIEmbedRequest"), {"not": {"required": ["input"]}}]}
    return _operation(
        "embed", "Embeddings: OpenAI's list shape; a TEI body (`inputs`, no `input`) gets TEI's answer",
        {"application/json": {"schema": {"anyOf": [_ref("EmbeddingRequest"), tei_body]},
                              "examples": _examples(_embedding_examples(model) | {"tei": {"inputs": ["hello world"]}})},
         "text/plain": {"schema": _ref("Text"), "example": "hello world"}},
        {"schema": {"anyOf": [_ref("EmbeddingList"), _ref("TEIEmbeddings")]}},
        _error_responses(EMBED_ERRORS, Route.NATIVE, model.server, also_tei=True, model=model))


def _openai(model: ServedModel) -> dict[str, Any]:
    return _operation(
        "createEmbedding", "Embeddings, OpenAI's embeddings API",
        {"application/json": {"schema": _ref("EmbeddingRequest"),
                              "examples": _examples(_embedding_examples(model))}},
        {"schema": _ref("EmbeddingList"), "example": _list_example(model)},
        _error_responses(EMBED_ERRORS, Route.OPENAI, model.server, model=model))


def _tei_embed(model: ServedModel) -> dict[str, Any]:
    example = {"inputs": ["hello", "world"], "truncate": True, "truncation_direction": "left"}
    return _operation(
        "teiEmbed", "Embeddings, TEI's /embed: one vector a text",
        {"application/json": {"schema": _ref("TEIEmbedRequest"), "examples": _examples({"texts": example})}},
        {"schema": _ref("TEIEmbeddings"), "example": [[0.0213, -0.0452, 0.0088]]},
        _error_responses(EMBED_ERRORS, Route.TEI_EMBED, model.server, model=model))


def _tei_similarity(model: ServedModel) -> dict[str, Any]:
    example = {"inputs": {"source_sentence": "a cat", "sentences": ["a kitten", "a car"]}}
    return _operation(
        "teiSimilarity", "Cosine of each sentence's embedding to the source sentence's, TEI's /similarity",
        {"application/json": {"schema": _ref("SimilarityRequest"), "examples": _examples({"sentences": example})}},
        {"schema": {"type": "array", "items": {"type": "number", "minimum": -1.0001, "maximum": 1.0001}},
         "example": [0.77, 0.35]},
        _error_responses(EMBED_ERRORS, Route.TEI_SIMILARITY, model.server, model=model))


def _tokenize(model: ServedModel) -> dict[str, Any]:
    example = [[{"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
                {"id": 7592, "text": "hello", "special": False, "start": 0, "stop": 5}]]
    return _operation(
        "teiTokenize", "Tokens of each text, TEI's /tokenize: ids, token texts, character offsets",
        {"application/json": {"schema": _ref("TokenizeRequest"),
                              "examples": _examples({"text": {"inputs": "hello world"}})}},
        {"schema": _ref("Tokens"), "example": example},
        _error_responses(TOKENIZE_ERRORS, Route.TEI_TOKENIZE, model.server, model=model))


def _info(operation_id: str, server: ServerProfile) -> dict[str, Any]:
    return _operation(operation_id, "The model, how it runs, and the limits (TEI's /info keys and more); "
                                    "any method, any body", None, {"schema": _ref("Info")},
                      _error_responses(DESCRIBE_ERRORS, Route.TEI_INFO, server))


def _openapi(server: ServerProfile) -> dict[str, Any]:
    return _operation("openapi", "This document, with the model's real values; any method, any body", None,
                      {"schema": _ref("OpenAPIDocument")}, _error_responses(DESCRIBE_ERRORS, Route.OPENAPI, server))


def _docs(server: ServerProfile) -> dict[str, Any]:
    operation = _operation("docs", "This document as a browsable page (Swagger UI, its files under docs/); any "
                                   "method, any body", None, {"schema": {"type": "string"}},
                           _error_responses(DESCRIBE_ERRORS, Route.DOCS, server))
    operation["responses"]["200"]["content"] = {"text/html": {"schema": {"type": "string"}}}
    operation["responses"]["404"] = {"description": "an archive built without the page's files, or an unknown "
                                                    "file name", "content": {"application/json": {
                                                        "schema": _ref("OpenAIError")}}}
    return operation


def _operation(operation_id: str, summary: str, request: dict | None, answer: dict,
               errors: dict[str, Any]) -> dict[str, Any]:
    operation: dict[str, Any] = {"operationId": operation_id, "summary": summary}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": request}
    operation["responses"] = {
        "200": {"description": "the answer", "headers": {"x-batch-size": _header(
            "how many requests the server batched with this one")},
                "content": {"application/json": answer}},
        **errors,
    }
    return operation


def _error_responses(kinds: tuple[ErrorKind, ...], route: Route, server: ServerProfile, *, also_tei: bool = False,
                     model: ServedModel | None = None) -> dict[str, Any]:
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

    examples = _error_examples(route, model) if model is not None else {}
    responses = {}
    for status in sorted(answers):
        whens, schemas = answers[status]
        response: dict[str, Any] = {"description": "; ".join(whens)}
        if schemas:  # else an empty body
            schema = _ref(schemas[0]) if len(schemas) == 1 else {"anyOf": [_ref(name) for name in schemas]}
            content: dict[str, Any] = {"schema": schema}
            if status in examples:
                content["example"] = examples[status]
            response["content"] = {"application/json": content}
        if status in (429, 503):
            response["headers"] = {"retry-after": _header("seconds to wait before retrying")}
        if status == METHOD_NOT_ALLOWED.status:
            response["headers"] = {"allow": _header(f"the method the route takes: {ALLOWED_METHOD}")}
        responses[str(status)] = response
    return responses


def _header(description: str) -> dict[str, Any]:
    return {"description": description, "schema": {"type": "string"}}


# --- examples --------------------------------------------------------------------------------------

def _embedding_examples(model: ServedModel) -> dict[str, Any]:
    examples = {
        "texts": {"input": ["The quick brown fox", "jumps over the lazy dog"]},
        "options": {"model": model.name, "input": "hello", "dimensions": min(64, model.dimension),
                    "encoding_format": "base64", "output_dtype": "int8"},
        "token ids": {"input": [[min(7592, model.vocab_size - 1), min(2088, model.vocab_size - 1)]]},
    }
    if model.prompts:
        examples["prompt"] = {"input": "what is an embedding?", "prompt_name": model.prompts[0]}
    return examples


def _examples(values: dict[str, Any]) -> dict[str, Any]:
    return {name.replace(" ", "_"): {"summary": name, "value": value} for name, value in values.items()}


def _list_example(model: ServedModel) -> dict[str, Any]:
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.0213, -0.0452, 0.0088]}],
            "model": model.name, "usage": {"prompt_tokens": 4, "total_tokens": 4}}


def _error_examples(route: Route, model: ServedModel) -> dict[int, Any]:
    """Real error bodies, made by the codec from bad requests on this route."""
    field = "inputs" if route.tei else "input"
    bodies = [(b"", None, "GET"), (b'{"%s": ["hello", 5]}' % field.encode(), "application/json", "POST")]
    examples = {}
    for body, content_type, method in bodies:
        try:
            ROUTES[route].parse(body, content_type, method)
        except RequestError as err:
            examples[err.http_status] = err.body()
    limit = model.settings.max_inputs_per_request
    error = too_large(f"'{field}' has {limit + 1} inputs; the limit is max_inputs_per_request={limit}", param=field)
    error.tei = route.tei
    examples[error.http_status] = error.body()
    return examples


# --- schemas ---------------------------------------------------------------------------------------

def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _schemas(model: ServedModel) -> dict[str, Any]:
    settings, dimension = model.settings, model.dimension
    many = {"type": "array", "minItems": 1, "maxItems": settings.max_inputs_per_request}
    options = {key: _option_schema(key, model) for key in OPTION_TYPES}
    ignored = {key: {"type": ["string", "null"], "description": OPTION_NOTES[key]} for key in IGNORED_FIELDS}
    vector = {"anyOf": [
        {"type": "array", "minItems": 1, "maxItems": dimension, "items": {"type": "number"}},
        {"type": "string", "contentEncoding": "base64"},
    ]}
    return {
        **_scoring_schemas(model, many, options),
        "Text": {"type": "string", "minLength": 1, "maxLength": settings.max_input_chars,
                 "description": f"one text, at most max_input_chars={settings.max_input_chars} characters"},
        "TokenIds": {"type": "array", "minItems": 1,
                     "items": {"type": "integer", "minimum": 0, "maximum": model.vocab_size - 1},
                     "description": "one pre-tokenized input: ids of the model's vocabulary, without special "
                                    "tokens (they are added)"},
        "Input": {"anyOf": [_ref("Text"), _ref("TokenIds"), {**many, "items": {"anyOf": [_ref("Text"),
                                                                                         _ref("TokenIds")]}}],
                  "description": "a text, a list of texts, one list of token ids, or a list of such lists"},
        "TEIInputs": {"anyOf": [_ref("Text"), {**many, "items": _ref("Text")}]},
        "EmbeddingRequest": {
            "type": "object", "required": ["input"],
            "properties": {"input": _ref("Input"), **{key: options[key] for key in EMBED_OPTIONS}, **ignored},
            "description": "other fields are accepted and ignored"},
        "TEIEmbedRequest": {
            "type": "object", "required": ["inputs"],
            "properties": {"inputs": _ref("TEIInputs"), **{key: options[key] for key in EMBED_OPTIONS}}},
        "SimilarityRequest": {
            "type": "object", "required": ["inputs"],
            "properties": {
                "inputs": {"type": "object", "required": ["source_sentence", "sentences"], "properties": {
                    "source_sentence": _ref("Text"),
                    "sentences": {**many, "maxItems": settings.max_inputs_per_request - 1, "items": _ref("Text")}}},
                **{key: options[key] for key in EMBED_OPTIONS if key not in ("output_dtype", "encoding_format")},
                **{key: {"enum": [OPTION_TYPES[key][1][0], None], "description": "only the default: the answer is "
                                                                                 "cosines"}
                   for key in ("output_dtype", "encoding_format")}}},
        "TokenizeRequest": {
            "type": "object", "required": ["inputs"],
            "properties": {"inputs": _ref("TEIInputs"), **{key: options[key] for key in TOKENIZE_OPTIONS}},
            "description": "the embedding options are checked as on /embed, and have no effect here"},
        "Vector": {**vector, "description": "JSON numbers, or a base64 string (encoding_format)"},
        "EmbeddingList": {
            "type": "object", "required": ["object", "data", "model", "usage"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "minItems": 1, "maxItems": settings.max_inputs_per_request, "items": {
                    "type": "object", "required": ["object", "index", "embedding"],
                    "properties": {"object": {"const": "embedding"}, "index": {"type": "integer", "minimum": 0},
                                   "embedding": _ref("Vector")}}},
                "model": {"const": model.name},
                "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
                    "prompt_tokens": {"type": "integer", "minimum": 1}, "total_tokens": {"type": "integer",
                                                                                         "minimum": 1}}}}},
        "TEIEmbeddings": {"type": "array", "minItems": 1, "maxItems": settings.max_inputs_per_request,
                          "items": _ref("Vector")},
        "Tokens": {"type": "array", "items": {"type": "array", "items": {
            "type": "object", "required": ["id", "text", "special", "start", "stop"],
            "properties": {"id": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                           "special": {"type": "boolean"}, "start": {"type": ["integer", "null"]},
                           "stop": {"type": ["integer", "null"]}},
            "description": "start, stop: character offsets in the text (null for special tokens)"}}},
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
                     "encoding_formats": {"const": list(OPTION_TYPES["encoding_format"][1])}}},
        "OpenAPIDocument": {"type": "object", "required": ["openapi", "info", "paths"]},
        "OpenAIError": _openai_error(),
        "TEIError": {
            "type": "object", "required": ["error", "error_type"], "additionalProperties": False,
            "properties": {"error": {"type": "string"},
                           "error_type": {"enum": sorted({kind.tei_type for kind in KINDS})}}},
        **model.server.error_schemas,
    }


def _scoring_schemas(model: ServedModel, many: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    if model.task is Task.EMBED:
        return {}
    common = {"raw_scores": {"type": ["boolean", "null"], "description": "the logits, without the activation"},
              "truncate": options["truncate"], "truncation_direction": options["truncation_direction"]}
    pair = {"type": "array", "prefixItems": [_ref("Text"), _ref("Text")], "minItems": 2, "maxItems": 2}
    document = {"anyOf": [_ref("Text"), {"type": "object", "required": ["text"], "properties": {"text": _ref("Text")}}]}
    label_score = {"type": "object", "required": ["score", "label"],
                   "properties": {"score": {"type": "number"}, "label": {"enum": list(model.labels)}}}
    return {
        "PredictRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"anyOf": [pair, {**many, "items": pair}]} if model.instructed else
            {"anyOf": [_ref("Text"), pair, {**many, "items": {"anyOf": [_ref("Text"), pair]}}]},
            **common}},
        "PredictAnswer": {"anyOf": [{"type": "array", "items": label_score},
                                    {"type": "array", "items": {"type": "array", "items": label_score}}]},
        "RerankRequest": {"type": "object", "required": ["query", "texts"], "properties": {
            "query": _ref("Text"), "texts": {**many, "items": _ref("Text")},
            "return_text": {"type": ["boolean", "null"]}, **common}},
        "RerankAnswer": {"type": "array", "items": {"type": "object", "required": ["index", "score"], "properties": {
            "index": {"type": "integer", "minimum": 0}, "score": {"type": "number"}, "text": {"type": "string"}}}},
        "CohereRerankRequest": {"type": "object", "required": ["query", "documents"], "properties": {
            "query": _ref("Text"), "documents": {**many, "items": document},
            "top_n": {"type": ["integer", "null"], "minimum": 1},
            "return_documents": {"type": ["boolean", "null"]}, "model": {"type": ["string", "null"]},
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


def _openai_error() -> dict[str, Any]:
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


def _option_schema(key: str, model: ServedModel) -> dict[str, Any]:
    kind, choices = OPTION_TYPES[key]
    default = getattr(Options(), key)
    if kind is bool:
        schema: dict[str, Any] = {"type": ["boolean", "null"]}
        if default is None:  # the server's setting
            default = getattr(model.settings, key)
    elif kind is int:
        schema = {"type": ["integer", "null"], "minimum": 1}
    elif key in CASE_INSENSITIVE:
        schema = {"type": ["string", "null"], "pattern": "|".join(f"^{_any_case(choice)}$" for choice in choices),
                  "examples": list(choices)}
    elif choices:
        schema = {"enum": [*choices, None]}
    else:
        schema = {"type": ["string", "null"]}
    if key == "dimensions":
        schema["maximum"] = model.dimension
        default = model.dimension
    if key == "prompt_name":  # the default: the `prompt` setting, else the model's default prompt
        schema = {"enum": [*model.prompts, None]}
    schema["description"] = OPTION_NOTES[key] + "; missing or null: the default"
    if default is not None:
        schema["default"] = default
    return schema


def _any_case(word: str) -> str:
    return "".join(f"[{char.upper()}{char.lower()}]" if char.isalpha() else char for char in word)
