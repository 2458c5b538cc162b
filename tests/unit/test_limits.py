"""Limits that hold and failures that stay with their request, in-process: answers sized before
anything is computed, each batch's work held inside the response timeout, and failures in the
forward pass, the cache and the encoding mapped back to the requests they belong to."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from embedserve.handler.api.quantize import OUTPUT_DTYPES, quantize
from embedserve.handler.api.route import Route
from embedserve.handler.assembly import with_work_bound
from embedserve.handler.routes.table import ROUTES
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.tasks.embed import EmbeddingRequest, Options, max_answer_bytes
from tests.support.wire import encode_embeddings
from tests.support.engines import make_engine
from tests.support.parts import poisoned

SHORT = ["hello world", "the cat sat on the mat", "one two three", "a", "b c d"]


def answers(engine, bodies, url_path=""):
    responses, report = engine.handle_with_report([RawRequest(json.dumps(b).encode(), None, url_path) for b in bodies])
    return responses, [json.loads(r.body) for r in responses], report


@pytest.mark.parametrize("route", list(Route)[:3])
@pytest.mark.parametrize("output_dtype", OUTPUT_DTYPES)
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_the_answer_bound_holds_for_the_longest_numbers(route, output_dtype, encoding_format):
    # -0.0000053924714 is the longest float32 orjson writes; the widest codes are -128 and 255.
    widest = {"float": -0.0000053924714, "uint8": 1.0, "ubinary": 1.0}.get(output_dtype, -1.0)
    rows = np.full((40, 384), widest, dtype=np.float32)
    request = EmbeddingRequest(route, ("x",) * 40, Options(output_dtype=output_dtype, encoding_format=encoding_format))
    body = encode_embeddings(request, quantize(rows, output_dtype), model_name="m" * 60, prompt_tokens=10**9)
    bound = max_answer_bytes(40, 384, output_dtype, encoding_format, "m" * 60, route)
    assert len(body) <= bound <= max_answer_bytes(40, 384, output_dtype, encoding_format, "m" * 60)  # any route
    # Not so loose that it refuses what would fit: floats, and base64 on the OpenAI route, where
    # codes take 4 bytes each as floats do.
    if output_dtype == "float" or (encoding_format == "base64" and route is Route.OPENAI):
        assert bound <= 1.25 * len(body)


def test_an_answer_too_large_for_the_frontend_is_refused_before_computing(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_response_bytes=20_000)
    texts = [f"text {i}" for i in range(40)]  # 40 x (32 x 17 + 64) bytes: over 20,000
    responses, bodies, report = answers(engine, [{"input": texts}, {"input": SHORT},
                                                 {"input": texts, "encoding_format": "base64"},
                                                 {"inputs": texts}], url_path="")
    assert [r.status for r in responses] == [413, 200, 200, 413]
    error = bodies[0]["error"]
    assert error["param"] == "input" and "max_response_bytes=20000" in error["message"] and "base64" in error["message"]
    assert report.inputs == len(SHORT) + 40  # the refused requests were never embedded
    responses, _, _ = answers(engine, [{"input": texts, "dimensions": 8}])
    assert responses[0].status == 200  # fewer dimensions fit


def test_base64_codes_on_the_openai_route_are_bounded_as_float32(tiny_model_dir):
    # 40 x 32 int8 codes in base64: 44 characters a row, one byte a code, on the native route;
    # 172 on the OpenAI route, 4 bytes a code, as OpenAI clients decode them.
    engine = make_engine(tiny_model_dir, max_response_bytes=6_000)
    texts = [f"text {i}" for i in range(40)]
    base64_codes = {"input": texts, "output_dtype": "int8", "encoding_format": "base64"}
    responses, _, _ = answers(engine, [base64_codes])
    assert responses[0].status == 200
    responses, bodies, report = answers(engine, [base64_codes, {"input": texts, "output_dtype": "int8"}],
                                        url_path="v1/embeddings")
    assert [r.status for r in responses] == [413, 413] and report.inputs == 0
    # JSON codes (at most 5 bytes each) are smaller than base64 there, so base64 is not suggested.
    assert all("base64" not in body["error"]["message"] for body in bodies)


def test_a_batch_holds_the_work_the_response_timeout_allows(tiny_model_dir, tiny_engine):
    engine = make_engine(tiny_model_dir)
    engine = with_work_bound(engine, 160.0, response_timeout_s=1.0)  # 40 tokens of work per batch (WORK_SHARE 0.25)
    assert engine.batch_work_tokens == 40 and engine.info()["max_tokens_per_request"] == 40
    long = [" ".join(["embedding"] * 20)] * 3  # 3 x 22 tokens
    bodies = [{"input": SHORT[:2]}, {"input": long}, {"input": SHORT[2:]}, {"input": SHORT[:3]},
              {"inputs": SHORT[:3]}]
    responses, answers_, report = answers(engine, bodies)
    # 12 tokens fit; the long request is over the budget alone (413); 13 more fit, then 17 do not
    # (503, and 429 on the TEI route).
    assert [r.status for r in responses] == [200, 413, 200, 503, 429]
    assert "160 tokens/s" in answers_[1]["error"]["message"] and "1 s response timeout" in answers_[1]["error"]["message"]
    assert answers_[3]["error"]["code"] == "overloaded" and responses[3].headers["retry-after"] == "1"
    assert answers_[4]["error_type"] == "Overloaded" and responses[4].headers["retry-after"] == "1"
    _, expected, _ = answers(tiny_engine, [bodies[0]])
    assert answers_[0]["data"] == expected[0]["data"]
    assert report.statuses == {200: 2, 413: 1, 503: 1, 429: 1}


def test_a_non_finite_vector_is_never_served_nor_cached(tiny_model_dir, tiny_engine):
    engine = make_engine(tiny_model_dir, cache_entries=100)
    engine = poisoned(engine, token=9, nan=True)
    bodies = [{"input": SHORT}, {"input": ["fine", [5, 9]]}]
    for round_ in range(2):
        responses, out, report = answers(engine, bodies)
        assert [r.status for r in responses] == [200, 500]
        assert out[1]["error"]["param"] == "input[1]" and "non-finite" in out[1]["error"]["message"]
        assert report.cache_misses == (7 if round_ == 0 else 1)  # the NaN vector was not kept
    _, expected, _ = answers(tiny_engine, [bodies[0]])
    np.testing.assert_allclose(np.array([d["embedding"] for d in out[0]["data"]]),
                               np.array([d["embedding"] for d in expected[0]["data"]]), atol=1e-6)


def test_a_cache_that_fails_costs_hits_not_answers(tiny_model_dir):
    engine = make_engine(tiny_model_dir, cache_entries=100)

    def broken(*args, **kwargs):
        raise KeyError("a bug in the cache")

    engine.cache.lookup = broken
    responses, _, report = answers(engine, [{"input": SHORT}, {"input": "x"}])
    assert [r.status for r in responses] == [200, 200] and report.cache_errors == 1
    engine.cache.store = broken
    responses, _, report = answers(engine, [{"input": SHORT}])
    assert responses[0].status == 200 and report.cache_errors == 2


def test_an_encoding_failure_fails_its_request_alone(tiny_engine, monkeypatch):
    def fragile(encode):
        def encode_or_fail(request, result, model_name):
            if request.options.dimensions == 7:
                raise ValueError("a bug in one answer's encoding")
            return encode(request, result, model_name)
        return encode_or_fail

    for route in (Route.NATIVE, Route.TEI_EMBED):
        monkeypatch.setitem(ROUTES, route, replace(ROUTES[route], encode=fragile(ROUTES[route].encode)))
    responses, out, report = answers(tiny_engine, [{"input": SHORT}, {"input": SHORT, "dimensions": 7},
                                                   {"inputs": SHORT, "dimensions": 7}])
    assert [r.status for r in responses] == [200, 500, 500]
    assert out[1]["error"]["code"] == "internal_error" and out[2]["error_type"] == "Backend"
    assert report.statuses == {200: 1, 500: 2}


def test_a_failing_forward_pass_is_traced_to_its_request(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine = poisoned(engine, token=9)
    bodies = [{"input": [s]} for s in SHORT] + [{"input": [[5, 9, 7]]}] + [{"input": s} for s in SHORT]
    responses, _, report = answers(engine, bodies)
    assert [r.status for r in responses] == [200] * 5 + [500] + [200] * 5
    assert report.statuses == {200: 10, 500: 1}


def test_one_tokenizer_call_per_batch_and_token_limits_stay_with_their_request(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, max_tokens_per_request=30)
    calls = []
    body_ids = engine.text.tokenizer.body_ids
    monkeypatch.setattr(engine.text.tokenizer, "body_ids", lambda texts: calls.append(len(texts)) or body_ids(texts))
    long = " ".join(["embedding"] * 60)
    bodies = [{"input": SHORT}, {"input": ["hello", long], "truncate": False}, {"input": "the cat sat"},
              {"input": [long, "x"]}, {"input": [[5, 6, 7], "a b"], "prompt_name": "query"}, {"input": []}]
    responses, out, _ = answers(engine, bodies)
    assert [r.status for r in responses] == [200, 413, 200, 413, 200, 400]
    assert calls == [len(SHORT) + 2 + 1 + 2 + 2]  # every text of the parsed requests, the prompted ids decoded
    assert out[1]["error"]["param"] == "input[1]" and "truncation is off" in out[1]["error"]["message"]
    assert "max_tokens_per_request=30" in out[3]["error"]["message"]
    for index in (0, 2, 4):  # each answered as it would be alone
        alone, alone_out, _ = answers(engine, [bodies[index]])
        np.testing.assert_allclose([d["embedding"] for d in out[index]["data"]],
                                   [d["embedding"] for d in alone_out[0]["data"]], atol=1e-6)
        assert out[index]["usage"] == alone_out[0]["usage"]


def test_a_text_that_breaks_the_tokenizer_fails_its_request_alone(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    body_ids = engine.text.tokenizer.body_ids

    def fragile(texts):
        if any("poison" in text for text in texts):
            raise RuntimeError("a tokenizer bug")
        return body_ids(texts)

    monkeypatch.setattr(engine.text.tokenizer, "body_ids", fragile)
    responses, out, report = answers(engine, [{"input": SHORT}, {"input": ["poison"]}, {"inputs": "poison"},
                                              {"input": "the cat"}])
    assert [r.status for r in responses] == [200, 500, 500, 200]
    assert out[1]["error"]["code"] == "internal_error" and out[2]["error_type"] == "Backend"
    assert report.inputs == len(SHORT) + 1
