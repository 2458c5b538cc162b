import base64
import json

import numpy as np
import pytest

from handler.codec import Route, encode_embeddings, encode_error, parse_request, parse_route
from handler.errors import RequestError


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
    assert parse(body).texts == ("hello",)


def test_list_input_keeps_order():
    assert parse({"input": ["b", "a", "c"]}).texts == ("b", "a", "c")


def test_text_plain_body_is_one_text():
    request = parse("Ünïcode text, {not json}".encode(), content_type="text/plain; charset=utf-8")
    assert request.texts == ("Ünïcode text, {not json}",)


def test_openai_route_and_options():
    request = parse({"model": "m", "input": ["x"], "encoding_format": "base64", "dimensions": 8, "user": "u"},
                    url_path="v1/embeddings")
    assert request.route is Route.OPENAI
    assert (request.encoding_format, request.dimensions) == ("base64", 8)


@pytest.mark.parametrize("path, route", [("", Route.NATIVE), (None, Route.NATIVE),
                                         ("v1/embeddings", Route.OPENAI), ("/v1/embeddings/", Route.OPENAI)])
def test_routes(path, route):
    assert parse_route(path) is route


def test_unknown_route_is_404():
    error = error_of({"input": "x"}, url_path="v2/embed")
    assert error.status == 404 and "v2/embed" in error.message


@pytest.mark.parametrize(
    "body, content_type, param, fragment",
    [
        (b'{"input": ', "application/json", "body", "not valid JSON"),
        (b"\xff\xfe bad", "application/json", "body", "not valid UTF-8"),
        (b"\xff\xfe bad", "text/plain", "body", "not valid UTF-8"),
        (b"", "text/plain", "body", "must not be an empty string"),
        (None, None, "body", "empty or form-encoded"),
        (b'["a", "b"]', "application/json", "body", "JSON object"),
        (b'{"inputs": "a"}', "application/json", "input", "missing required field 'input'"),
        (b'{"input": 3}', "application/json", "input", "got a number"),
        (b'{"input": {"a": 1}}', "application/json", "input", "got an object"),
        (b'{"input": []}', "application/json", "input", "empty list"),
        (b'{"input": ""}', "application/json", "input", "empty string"),
        (b'{"input": ["a", "", "c"]}', "application/json", "input[1]", "empty string"),
        (b'{"input": ["a", "b", 7]}', "application/json", "input[2]", "got a number"),
        (b'{"input": [["a", "b"]]}', "application/json", "input[0]", "got a list"),
        (b'{"input": [null]}', "application/json", "input[0]", "got null"),
        (b'{"input": "a", "encoding_format": "int4"}', "application/json", "encoding_format", "int4"),
        (b'{"input": "a", "dimensions": 0}', "application/json", "dimensions", "positive integer"),
        (b'{"input": "a", "dimensions": -3}', "application/json", "dimensions", "positive integer"),
        (b'{"input": "a", "dimensions": "8"}', "application/json", "dimensions", "positive integer"),
        (b'{"input": "a", "dimensions": true}', "application/json", "dimensions", "positive integer"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(body, content_type, param, fragment):
    error = error_of(body, content_type)
    assert error.status == 400
    assert error.param == param
    assert fragment in error.message
    body = json.loads(encode_error(error))
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param


def test_float_response_shape():
    vectors = np.array([[0.5, -0.25], [1.0, 0.0]], dtype=np.float32)
    body = json.loads(encode_embeddings(vectors, model_name="m", prompt_tokens=7))
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in body["data"])
    assert body["data"][0]["embedding"] == [0.5, -0.25]


def test_base64_is_little_endian_float32():
    vectors = np.array([[0.1, -2.5, 3.25]], dtype=np.float32)
    body = json.loads(encode_embeddings(vectors, model_name="m", prompt_tokens=1, encoding_format="base64"))
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, vectors[0])
