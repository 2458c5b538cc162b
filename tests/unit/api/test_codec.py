import base64
import json

import numpy as np
import pytest

from embedserve.handler.api.codec import encode_error
from embedserve.handler.api.route import Route
from embedserve.handler.tasks.embed import EmbeddingRequest, Options
from tests.support.wire import encode_embeddings, parse_request, parse_route
from embedserve.handler.api.errors import RequestError


def parse(body, content_type="application/json", url_path=""):
    return parse_request(body, content_type, url_path)


def error_of(body, content_type="application/json", url_path="") -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse(body, content_type, url_path)
    return caught.value


@pytest.mark.parametrize(
    "body",
    [b'{"input": "hello"}', '{"input": "hello"}', {"input": "hello"}, bytearray(b'{"input": "hello"}')],
)
def test_json_body_in_every_form_torchserve_may_deliver(body):
    assert parse(body).inputs == ("hello",)


def test_list_input_keeps_order():
    assert parse({"input": ["b", "a", "c"]}).inputs == ("b", "a", "c")


def test_text_plain_body_is_one_text():
    request = parse("Ünïcode text, {not json}".encode(), content_type="text/plain; charset=utf-8")
    assert request.inputs == ("Ünïcode text, {not json}",)
    assert request.route is Route.NATIVE


def test_openai_route_and_options():
    request = parse({"model": "m", "input": ["x"], "encoding_format": "base64", "dimensions": 8, "user": "u",
                     "output_dtype": "int8", "normalize": False, "truncate": False, "prompt_name": "query",
                     "truncation_direction": "Left"}, url_path="v1/embeddings")
    assert request.route is Route.OPENAI
    assert request.options == Options(normalize=False, truncate=False, truncation_direction="left",
                                      prompt_name="query", dimensions=8, output_dtype="int8",
                                      encoding_format="base64")


def test_defaults_leave_server_settings_in_charge():
    assert parse({"input": "x"}).options == Options()
    assert Options().normalize is None and Options().truncate is None


def test_pre_tokenized_inputs():
    assert parse({"input": [101, 7592, 102]}).inputs == ((101, 7592, 102),)
    assert parse({"input": [[1, 2], "text", [3]]}).inputs == ((1, 2), "text", (3,))


def test_tei_body_on_embed_and_on_the_bare_route():
    for path in ("embed", ""):
        request = parse({"inputs": ["a", "b"], "normalize": False}, url_path=path)
        assert request.route is Route.TEI_EMBED and request.field == "inputs"
        assert request.inputs == ("a", "b") and request.options.normalize is False


def test_tokenize_and_info_routes():
    request = parse({"inputs": "a", "add_special_tokens": False}, url_path="tokenize")
    assert request.route is Route.TEI_TOKENIZE and request.options.add_special_tokens is False
    assert parse(None, None, "info") == EmbeddingRequest(Route.TEI_INFO)


@pytest.mark.parametrize("path, route", [("", Route.NATIVE), (None, Route.NATIVE),
                                         ("v1/embeddings", Route.OPENAI), ("/v1/embeddings/", Route.OPENAI),
                                         ("embed", Route.TEI_EMBED), ("tokenize", Route.TEI_TOKENIZE),
                                         ("info", Route.TEI_INFO)])
def test_routes(path, route):
    assert parse_route(path) is route


def test_unknown_route_is_404():
    error = error_of({"input": "x"}, url_path="v3/embed")
    assert error.http_status == 404 and "v3/embed" in error.message


@pytest.mark.parametrize(
    "body, content_type, param, fragment",
    [
        (b'{"input": ', "application/json", "body", "not valid JSON"),
        (b"\xff\xfe bad", "application/json", "body", "not valid UTF-8"),
        (b"\xff\xfe bad", "text/plain", "body", "not valid UTF-8"),
        (b"", "text/plain", "body", "must not be an empty string"),
        (None, None, "body", "empty or form-encoded"),
        (b'["a", "b"]', "application/json", "body", "JSON object"),
        (b'{"text": "a"}', "application/json", "input", "missing required field 'input'"),
        (b'{"input": 3}', "application/json", "input", "got a number"),
        (b'{"input": {"a": 1}}', "application/json", "input", "got an object"),
        (b'{"input": []}', "application/json", "input", "empty list"),
        (b'{"input": ""}', "application/json", "input", "empty string"),
        (b'{"input": ["a", "", "c"]}', "application/json", "input[1]", "empty string"),
        (b'{"input": ["a", "b", 7]}', "application/json", "input[2]", "got a number"),
        (b'{"input": [["a", "b"]]}', "application/json", "input[0][0]", "token id"),
        (b'{"input": [[]]}', "application/json", "input[0]", "empty list of token ids"),
        (b'{"input": [1, -2]}', "application/json", "input[1]", "non-negative"),
        (b'{"input": [1, 2.5]}', "application/json", "input[1]", "non-negative"),
        (b'{"input": [null]}', "application/json", "input[0]", "got null"),
        (b'{"input": "a", "encoding_format": "int4"}', "application/json", "encoding_format", "int4"),
        (b'{"input": "a", "output_dtype": "fp8"}', "application/json", "output_dtype", "fp8"),
        (b'{"input": "a", "dimensions": 0}', "application/json", "dimensions", "positive integer"),
        (b'{"input": "a", "dimensions": -3}', "application/json", "dimensions", "positive integer"),
        (b'{"input": "a", "dimensions": "8"}', "application/json", "dimensions", "positive integer"),
        (b'{"input": "a", "dimensions": true}', "application/json", "dimensions", "positive integer"),
        (b'{"input": "a", "normalize": "yes"}', "application/json", "normalize", "true or false"),
        (b'{"input": "a", "truncate": 1}', "application/json", "truncate", "true or false"),
        (b'{"input": "a", "truncation_direction": "middle"}', "application/json", "truncation_direction", "middle"),
        (b'{"input": "a", "prompt_name": 3}', "application/json", "prompt_name", "a string"),
        # Of two bad options, the one first in the options' table is named, whatever the body's order.
        (b'{"input": "a", "dimensions": 0, "normalize": "yes"}', "application/json", "normalize", "true or false"),
        (b'{"input": "a", "chunk_spans": 3, "model": 7}', "application/json", "model", "a string"),
        (b"[" * 100000 + b"]" * 100000, "application/json", "body", "nested too deeply"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(body, content_type, param, fragment):
    error = error_of(body, content_type)
    assert error.http_status == 400
    assert error.param == param
    assert fragment in error.message
    body = json.loads(encode_error(error))
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b'{"inputs": [1, 2]}', "'inputs[0]' must be a string"),  # TEI takes no token ids
        (b'{"input": "x"}', "missing required field 'inputs'"),
        (b'{"inputs": []}', "empty list"),
        (b'{"inputs": ', "not valid JSON"),
    ],
)
def test_tei_routes_answer_tei_errors(body, fragment):
    error = error_of(body, url_path="embed")
    assert error.http_status == 400
    rendered = json.loads(encode_error(error))
    assert set(rendered) == {"error", "error_type"} and fragment in rendered["error"]
    assert rendered["error_type"] in ("Validation", "Empty")


def test_openai_shape_response():
    vectors = np.array([[0.5, -0.25], [1.0, 0.0]], dtype=np.float32)
    body = json.loads(encode_embeddings(EmbeddingRequest(Route.OPENAI), vectors, model_name="m", prompt_tokens=7))
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in body["data"])
    assert body["data"][0]["embedding"] == [0.5, -0.25]


def test_tei_shape_response_is_a_bare_list():
    vectors = np.array([[0.5, -0.25]], dtype=np.float32)
    body = json.loads(encode_embeddings(EmbeddingRequest(Route.TEI_EMBED), vectors, model_name="m", prompt_tokens=1))
    assert body == [[0.5, -0.25]]


# The widest values of each output dtype, as quantize gives them.
CODES = {
    "float": np.array([[0.1, -2.5, 3.25, -0.0000053924714]], dtype=np.float32),
    "int8": np.array([[-128, -1, 0, 127]], dtype=np.int8),
    "uint8": np.array([[0, 1, 128, 255]], dtype=np.uint8),
    "binary": np.array([[-128, -1, 0, 127]], dtype=np.int8),  # packed bits, shifted by -128
    "ubinary": np.array([[0, 1, 128, 255]], dtype=np.uint8),  # packed bits
}


@pytest.mark.parametrize("output_dtype", list(CODES))
@pytest.mark.parametrize("route", [Route.NATIVE, Route.OPENAI, Route.TEI_EMBED])
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_every_dtype_route_and_encoding_decodes_to_the_codes(output_dtype, route, encoding_format):
    codes = CODES[output_dtype]
    request = EmbeddingRequest(route, options=Options(output_dtype=output_dtype, encoding_format=encoding_format))
    body = json.loads(encode_embeddings(request, codes, model_name="m", prompt_tokens=1))
    [row] = body if route.tei else [d["embedding"] for d in body["data"]]
    if encoding_format == "float":
        got = np.array(row, dtype=np.float32)  # JSON numbers, read back as float32 round-trips exactly
    elif route is Route.OPENAI or output_dtype == "float":
        # What OpenAI clients do with every base64 embedding, whatever the output dtype.
        got = np.frombuffer(base64.b64decode(row), "<f4")
    else:  # compact: one byte a code, in the dtype's own type
        got = np.frombuffer(base64.b64decode(row), codes.dtype)
    np.testing.assert_array_equal(got, codes[0])


def test_a_request_without_options_gets_the_defaults_as_one_with_them_spelled_out():
    from embedserve.handler.tasks.embed import Options, parse_options

    assert parse_options({"input": "a", "extra": {"ignored": True}}) == Options()
    assert parse_options({"input": "a", "model": "m", "normalize": None, "encoding_format": "float"}) == Options()
    assert parse_options({"input": "a", "truncation_direction": "Left", "dimensions": 8.0}) == \
        Options(truncation_direction="left", dimensions=8)
