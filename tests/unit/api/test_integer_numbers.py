"""A JSON number of integral value is an integer wherever a request takes one, as JSON Schema
counts it and pydantic-based servers take it: `"dimensions": 16.0` is 16, a token id `17.0` is 17,
`"top_n": 2.0` is 2. A fractional number and a boolean are still refused, naming the field.

The bodies are the JSON text a client sends (Python's json.dumps writes 16.0 as `16.0` too),
answered by the engine through the whole request path."""

from __future__ import annotations

import json

import pytest

from embedserve.handler.api.exchange import RawRequest
from tests.support.engines import make_engine
from tests.support.rerankers import make_reranker


def call(engine, body: str, route: str) -> tuple[int, object]:
    [response] = engine.handle([RawRequest(body.encode(), "application/json", route)])
    return response.status, json.loads(response.body)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return make_engine(make_reranker("bert", tmp_path_factory.mktemp("integers") / "bert"))


@pytest.mark.parametrize("route, field", [("", "input"), ("v1/embeddings", "input"), ("embed", "inputs")])
def test_integral_dimensions_are_that_integer(tiny_engine, route, field):
    status, got = call(tiny_engine, f'{{"{field}": ["a cat", "a car"], "dimensions": 16.0}}', route)
    assert status == 200, got
    assert got == call(tiny_engine, f'{{"{field}": ["a cat", "a car"], "dimensions": 16}}', route)[1]
    rows = got if route == "embed" else [item["embedding"] for item in got["data"]]
    assert [len(row) for row in rows] == [16, 16]


@pytest.mark.parametrize("ids", ["[[5.0, 17.0, 9]]", "[5.0, 17, 9.0]"])  # a list of inputs; one input
def test_integral_token_ids_are_those_ids(tiny_engine, ids):
    status, got = call(tiny_engine, f'{{"input": {ids}}}', "v1/embeddings")
    assert status == 200, got
    assert got == call(tiny_engine, '{"input": [[5, 17, 9]]}', "v1/embeddings")[1]


@pytest.mark.parametrize("route", ["v1/rerank", "v2/rerank"])
def test_integral_top_n_is_that_integer(reranker, route):
    body = '{"query": "a cat", "documents": ["a kitten", "a car", "a dog"], "top_n": %s}'
    status, got = call(reranker, body % "2.0", route)
    assert status == 200, got
    assert len(got["results"]) == 2 and got["results"] == call(reranker, body % "2", route)[1]["results"]


@pytest.mark.parametrize("body, route, param", [
    ('{"input": "a cat", "dimensions": 16.5}', "v1/embeddings", "dimensions"),
    ('{"input": "a cat", "dimensions": true}', "v1/embeddings", "dimensions"),
    ('{"input": "a cat", "dimensions": 16.5}', "", "dimensions"),
    ('{"input": [[5, 17.5, 9]]}', "v1/embeddings", "input[0][1]"),
    ('{"input": [[5, true, 9]]}', "v1/embeddings", "input[0][1]"),
    ('{"input": [[5, false]]}', "", "input[0][1]"),
    ('{"input": [5.5, 17]}', "v1/embeddings", "input[0]"),  # not token ids: a list of texts
    ('{"input": [true, 17]}', "v1/embeddings", "input[0]"),
])
def test_fractions_and_booleans_are_still_refused_naming_the_field(tiny_engine, body, route, param):
    status, answer = call(tiny_engine, body, route)
    assert status == 400 and answer["error"]["param"] == param, answer


@pytest.mark.parametrize("value", ["1.5", "true", "false"])
@pytest.mark.parametrize("route", ["v1/rerank", "v2/rerank"])
def test_a_fractional_or_boolean_top_n_is_still_refused(reranker, route, value):
    body = '{"query": "a cat", "documents": ["a kitten", "a car"], "top_n": %s}' % value
    status, answer = call(reranker, body, route)
    assert status == 400 and answer["error"]["param"] == "top_n", answer


def test_a_fractional_dimensions_on_tei_s_route_is_refused_naming_it(tiny_engine):
    status, answer = call(tiny_engine, '{"inputs": "a cat", "dimensions": 16.5}', "embed")
    assert status == 400 and "'dimensions'" in answer["error"], answer
