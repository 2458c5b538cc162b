"""The OpenAPI document against the code it describes: every route, option, limit and error kind
appears with the code's own values, the document is valid OpenAPI 3.1, its schemas accept and
refuse what the codec accepts and refuses, and docs/api.md names the same facts."""

import json
from pathlib import Path

import jsonschema
import pytest
from openapi_spec_validator import validate

from embedserve.handler.api.errors import KINDS
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes.openapi import openapi_document
from embedserve.handler.routes.schema import EMBED_OPTIONS, TOKENIZE_OPTIONS, ServedModel, limits
from embedserve.handler.routes.table import spec_for
from embedserve.handler.tasks.embed import IGNORED_FIELDS, OPTION_TYPES
from embedserve.handler.torchserve.profile import TORCHSERVE
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.settings import Settings
from tests.support.engines import make_engine

API_DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"
SETTINGS = Settings(max_inputs_per_request=50, max_input_chars=300, max_tokens_per_request=9000,
                    max_response_bytes=123_456, normalize=True, truncate=False)
MODEL = ServedModel(name="tiny", version="2.0", dimension=32, max_length=48, vocab_size=177,
                    prompts=("document", "query"), settings=SETTINGS, max_tokens_per_request=7000, server=TORCHSERVE)
TORCHSERVE_ANSWERS = [(answer.status, answer.when, answer.schema) for answer in TORCHSERVE.answers]


@pytest.fixture(scope="module")
def document():
    return openapi_document(MODEL)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The tiny model served with low limits, so the tests reach each of them."""
    return make_engine(tiny_model_dir, max_inputs_per_request=50, max_input_chars=300, truncate=False)


def schema_of(document, name):
    """A component schema with its references resolvable, for jsonschema."""
    return {**document["components"]["schemas"][name], "components": document["components"]}


def test_the_document_is_valid_openapi_3_1(document):
    validate(document)
    assert document["openapi"].startswith("3.1")
    json.dumps(document)  # served as JSON: nothing but JSON values


def test_every_route_has_its_path_with_the_model_s_name_and_version(document):
    paths = document["paths"]
    assert set(paths["/predictions/tiny"]) == {"post"}
    for route in Route:
        spec = spec_for(route, Task.EMBED)
        if route is not Route.NATIVE and spec is not None:  # a reranker's or sparse model's routes: their own documents
            assert f"/predictions/tiny/2.0/{route.value}" in paths, route
    assert set(paths["/predictions/tiny/2.0/info"]) == {"get", "post"}
    assert set(paths["/predictions/tiny/2.0/openapi.json"]) == {"get"}


def test_every_limit_has_the_live_value(document):
    assert document["info"]["x-limits"] == limits(MODEL) == {
        "dimension": 32, "max_input_length": 48, "max_inputs_per_request": 50, "max_input_chars": 300,
        "max_tokens_per_request": 7000, "max_response_bytes": 123_456}
    schemas = document["components"]["schemas"]
    assert schemas["Text"]["maxLength"] == 300 and schemas["Text"]["minLength"] == 1
    assert schemas["TokenIds"]["items"]["maximum"] == 176
    assert schemas["TEIInputs"]["anyOf"][1]["maxItems"] == 50
    assert schemas["EmbeddingRequest"]["properties"]["dimensions"]["maximum"] == 32
    for key, value in limits(MODEL).items():
        assert f"{key} {value}" in document["info"]["description"]


def test_every_codec_option_appears_with_its_type_values_and_default(document):
    schemas = document["components"]["schemas"]
    embed = schemas["EmbeddingRequest"]["properties"]
    tei = schemas["TEIEmbedRequest"]["properties"]
    tokenize = schemas["TokenizeRequest"]["properties"]
    assert set(EMBED_OPTIONS) | set(TOKENIZE_OPTIONS) == set(OPTION_TYPES)
    assert set(embed) == {"input", *EMBED_OPTIONS, *IGNORED_FIELDS}
    # OpenAI's `model` and `user` too: checked to be strings on TEI's routes as well, then ignored
    assert set(tei) == {"inputs", *EMBED_OPTIONS, *IGNORED_FIELDS}
    # /tokenize checks every embedding option's type and choices (found by the fuzzer), so it declares them all
    assert set(tokenize) == {"inputs", *EMBED_OPTIONS, *IGNORED_FIELDS} and set(TOKENIZE_OPTIONS) <= set(tokenize)
    assert "maximum" not in tokenize["dimensions"] and "chunk" in tokenize["long_input"]["enum"]
    for key, (kind, choices) in OPTION_TYPES.items():
        schema = embed.get(key) or tokenize[key]
        if key == "modality":  # the tiny model reads texts only: its document offers no other
            assert schema["enum"] == [choices[0], None] and schema["default"] == choices[0]
        elif choices and "enum" in schema:
            assert schema["enum"] == [*choices, None]
            assert schema["default"] == choices[0]
        elif choices:  # matched in any case
            assert [choice for choice in choices if jsonschema.Draft202012Validator(schema).is_valid(choice)] \
                == list(choices)
        elif key != "prompt_name":  # the model's prompts, below
            assert {bool: "boolean", int: "integer", str: "string", list: "array"}[kind] in str(schema), key
    assert embed["normalize"]["default"] is True and embed["truncate"]["default"] is False  # the settings'
    assert embed["prompt_name"]["enum"] == ["document", "query", None]
    assert tokenize["add_special_tokens"]["default"] is True


@pytest.mark.parametrize("route", [Route.NATIVE, Route.OPENAI, Route.TEI_EMBED, Route.TEI_TOKENIZE])
def test_every_error_kind_of_a_route_has_its_status_and_shape(document, route):
    operation = _operation(document, route)
    shape = "TEIError" if route.tei else "OpenAIError"
    for status in (400, 405, 413, 500):
        assert shape in json.dumps(operation["responses"][str(status)]), (route, status)
    assert "OpenAIError" in json.dumps(operation["responses"]["503"])  # a whole batch's failure, on any route
    if route is not Route.TEI_TOKENIZE:
        expected = {"422", "429"} if route.tei or route is Route.NATIVE else set()
        assert expected <= set(operation["responses"]) and "507" in operation["responses"]
    for status, _, schema in TORCHSERVE_ANSWERS:
        assert str(status) in operation["responses"]
        if schema:
            assert schema in json.dumps(operation["responses"][str(status)])
    assert operation["responses"]["405"]["headers"]["allow"]


def test_error_schemas_list_every_kind(document):
    schemas = document["components"]["schemas"]
    assert schemas["OpenAIError"]["properties"]["error"]["properties"]["code"]["enum"] == [k.code for k in KINDS]
    assert set(schemas["TEIError"]["properties"]["error_type"]["enum"]) == {k.tei_type for k in KINDS}


@pytest.mark.parametrize("body", [
    {"input": "hello"}, {"input": ["a", "b"]}, {"input": [1, 2]}, {"input": [[1], "x"]},
    {"input": "x", "dimensions": 32, "truncation_direction": "Left", "prompt_name": "query", "model": "m"},
    {"input": "x", "normalize": None, "output_dtype": None, "unknown": 5},
    {"input": "x", "dimensions": 16.0, "output_dtype": "int8"},
    {"input": "x", "normalize": False, "output_dtype": "binary"},
])
def test_the_schema_accepts_what_the_service_accepts(engine, body):
    jsonschema.validate(body, schema_of(engine.openapi(), "EmbeddingRequest"))
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", "v1/embeddings")])
    assert response.status == 200, response.body


@pytest.mark.parametrize("body", [
    {}, {"input": ""}, {"input": []}, {"input": [[]]}, {"input": [1, "x"]}, {"input": [-1]}, {"input": [True]},
    {"input": "x" * 301}, {"input": ["x"] * 51}, {"input": [177]}, {"input": 5},
    {"input": "x", "dimensions": 0}, {"input": "x", "dimensions": 33}, {"input": "x", "dimensions": 1.5},
    {"input": "x", "normalize": "yes"}, {"input": "x", "truncation_direction": "up"},
    {"input": "x", "output_dtype": "INT8"}, {"input": "x", "encoding_format": "hex"},
    {"input": "x", "normalize": False, "output_dtype": "int8"},
    {"input": "x", "normalize": False, "output_dtype": "uint8"},
    {"input": "x", "prompt_name": "passage"}, {"input": "x", "model": 5}, {"input": "x", "user": []},
])
def test_the_schema_refuses_what_the_service_refuses(engine, body):
    assert not jsonschema.Draft202012Validator(schema_of(engine.openapi(), "EmbeddingRequest")).is_valid(body)
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", "v1/embeddings")])
    assert 400 <= response.status < 500, (body, response.body)


def test_tokenize_checks_the_embedding_options_types_not_their_bounds(engine):
    """/tokenize ignores the embedding options: more `chunk_spans` lists than inputs (even more than
    max_inputs_per_request) are answered, so its schema bounds neither."""
    body = {"inputs": "hello", "chunk_spans": [[[0, 1]]] * 51, "dimensions": 33}
    jsonschema.validate(body, schema_of(engine.openapi(), "TokenizeRequest"))
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", "tokenize")])
    assert response.status == 200, response.body
    wrong_type = {"inputs": "hello", "chunk_spans": [[[0]]]}
    assert not jsonschema.Draft202012Validator(schema_of(engine.openapi(), "TokenizeRequest")).is_valid(wrong_type)
    [response] = engine.handle([RawRequest(json.dumps(wrong_type).encode(), "application/json", "tokenize")])
    assert response.status == 400, response.body


def test_a_get_answers_405_naming_the_allowed_method(engine):
    for path in ("", "v1/embeddings", "embed", "tokenize"):
        [response] = engine.handle([RawRequest(b"", None, path, method="GET")])
        assert response.status == 405 and response.headers["allow"] == "POST", path
        message = json.loads(response.body)["error"]
        message = message if isinstance(message, str) else message["message"]
        assert "POST" in message and "GET" in message
    [response] = engine.handle([RawRequest(b"", None, "", method="PUT")])
    assert response.status == 405 and "PUT" in json.loads(response.body)["error"]["message"]
    for path in ("info", "openapi.json"):  # any method
        [response] = engine.handle([RawRequest(b"", None, path)])
        assert response.status == 200


def test_an_empty_post_with_a_content_type_is_400_not_405(engine):
    [response] = engine.handle([RawRequest(b"", "application/json", "")])
    assert response.status == 400 and json.loads(response.body)["error"]["param"] == "body"


def test_the_service_serves_its_own_document(engine):
    [response] = engine.handle([RawRequest(b"", None, "openapi.json")])
    served = json.loads(response.body)
    validate(served)
    info = engine.info()
    assert served["info"]["x-limits"] == {
        "dimension": info["embedding_dimension"], "max_input_length": info["max_input_length"],
        "max_inputs_per_request": info["max_client_batch_size"], "max_input_chars": info["max_input_chars"],
        "max_tokens_per_request": info["max_tokens_per_request"], "max_response_bytes": info["max_response_bytes"]}


def test_error_messages_never_echo_megabytes(engine):
    [response] = engine.handle([RawRequest({"input": [1, "x" * 5_000_000]}, "application/json", "")])
    assert response.status == 400 and len(response.body) < 10_000


def test_a_json_string_body_is_not_a_text(engine):
    [as_json] = engine.handle([RawRequest(b'"hello"', "application/json", "embed")])
    [as_text] = engine.handle([RawRequest(b'hello', "text/plain", "")])
    assert as_json.status == 400 and "JSON object" in json.loads(as_json.body)["error"]
    assert as_text.status == 200


def test_a_tokenize_answer_over_max_response_bytes_is_413(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_response_bytes=2000)
    [response] = engine.handle([RawRequest({"inputs": ["hello world " * 20]}, "application/json", "tokenize")])
    assert response.status == 413 and "max_response_bytes=2000" in json.loads(response.body)["error"]


def test_docs_api_names_every_option_limit_and_error_code():
    text = API_DOC.read_text()
    for name in [*OPTION_TYPES, *IGNORED_FIELDS, *limits(MODEL), *(kind.code for kind in KINDS)]:
        assert f"`{name}`" in text, name
    for route in Route:
        assert route.value in text


def _operation(document, route):
    path = "/predictions/tiny" + (f"/2.0/{route.value}" if route.value else "")
    return document["paths"][path]["post"]
