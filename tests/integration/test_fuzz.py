"""Bad input, fuzzed, through the real TorchServe: generated malformed requests are sent at the same
moment as good ones, so they share TorchServe batches. Every bad request gets its 4xx with a JSON
body, every good one a correct 200, and the worker never restarts. A property-based run
(hypothesis) explores the shapes; a volume run sends 10,000 requests, the largest shapes the
limits allow among them."""

import json
import string
from collections import Counter

import numpy as np
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.client import concurrently
from tests.support.fuzz import (FRONTEND_413, MAX_INPUTS, MAX_REQUEST_BYTES, ROUTES, Case, Served, bad, json_body,
                                run_volume, workers)
from tests.support.tiny_model import PROMPTS

pytestmark = pytest.mark.integration

DIMENSION = 32  # the tiny model's
VOCAB_SIZE = 177
KNOWN_PATHS = set(ROUTES) | {"tokenize", "info"}
EXAMPLES = 60


# Text with anything Unicode allows, control characters included; no lone surrogates (not text).
text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=80)


@st.composite
def good(draw) -> Case:
    path = draw(st.sampled_from(sorted(ROUTES)))
    texts = draw(st.lists(text, min_size=1, max_size=4))
    body = {ROUTES[path]: texts}
    if path != "embed":
        body.update(draw(st.fixed_dictionaries({}, optional={
            "dimensions": st.integers(1, DIMENSION),
            "encoding_format": st.sampled_from(["float", "base64"]),
            "prompt_name": st.sampled_from(sorted(PROMPTS)),
            "truncation_direction": st.sampled_from(["right", "left"]),
        })))
    return Case("good", json_body(body), path, inputs=len(texts))


def _not_json(data: bytes) -> bool:
    try:
        json.loads(data)
        return False
    except (ValueError, RecursionError):
        return True


not_a_text = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                       st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
absurd_option = st.one_of(
    st.fixed_dictionaries({"dimensions": st.one_of(st.integers(max_value=0), st.integers(min_value=DIMENSION + 1),
                                                   # an integral float in range is that integer: valid
                                                   st.floats().filter(lambda v: not (v.is_integer() and
                                                                                     1 <= v <= DIMENSION)),
                                                   st.text(max_size=5))}),
    st.fixed_dictionaries({"output_dtype": st.text(max_size=8).filter(
        lambda v: v not in ("float", "int8", "uint8", "binary", "ubinary"))}),
    st.fixed_dictionaries({"encoding_format": st.text(max_size=8).filter(lambda v: v not in ("float", "base64"))}),
    st.fixed_dictionaries({"truncate": st.one_of(st.integers(), st.text(max_size=5))}),
    st.fixed_dictionaries({"normalize": st.one_of(st.integers(), st.text(max_size=5))}),
    st.fixed_dictionaries({"truncation_direction": st.text(max_size=8).filter(
        lambda v: v.lower() not in ("left", "right"))}),
    st.fixed_dictionaries({"prompt_name": st.text(max_size=8).filter(lambda v: v not in PROMPTS)}),
)

bad_requests = st.one_of(
    st.binary(max_size=200).filter(_not_json).map(lambda b: bad("invalid JSON", b)),
    not_a_text.map(lambda v: bad("wrong type", {"input": v})),
    st.lists(not_a_text, min_size=1, max_size=3).map(lambda v: bad("wrong item type", {"input": ["fine", *v]})),
    st.integers(100, 200_000).map(lambda depth: bad("deeply nested", b"[" * depth + b"]" * depth)),
    st.integers(2, 5000).map(lambda depth: bad("deeply nested input",
                                               b'{"input": ' + b"[" * depth + b"]" * depth + b"}")),
    st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]).map(
        lambda raw: bad("invalid UTF-8", b'{"input": "ok ' + raw + b'"}')),
    st.sampled_from(["\\ud800", "\\udfff", "a\\udbffb"]).map(
        lambda s: bad("lone surrogate", b'{"input": "' + s.encode() + b'"}')),
    st.tuples(st.sampled_from(sorted(ROUTES)), st.integers(VOCAB_SIZE, 2**70)).map(
        lambda r: bad("token id out of range", {ROUTES[r[0]]: [[5, r[1]]]}, (400, 422), r[0])),
    st.integers(max_value=-1).map(lambda t: bad("negative token id", {"input": [[5, t]]})),
    absurd_option.map(lambda o: bad("absurd option", {"input": "x", **o}, (400, 422))),
    st.sampled_from(["", [], [""]]).map(lambda v: bad("empty input", {"input": v})),
    st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=12).filter(
        lambda p: p not in KNOWN_PATHS).map(lambda p: bad("unknown route", {"input": "x"}, (404,), p)),
    st.just(bad("too many inputs", {"input": ["x"] * (MAX_INPUTS + 1)}, (413,))),
    st.just(bad(FRONTEND_413, b'{"input": "' + b"a" * MAX_REQUEST_BYTES + b'"}', (413,))),
    st.just(bad("form-encoded", b"input=hello", content_type="application/x-www-form-urlencoded")),
)


def send(server, case: Case) -> requests.Response:
    url = f"{server.url('inference')}/predictions/tiny" + (f"/1.0/{case.path}" if case.path else "")
    return requests.post(url, data=case.body, timeout=60,
                         headers={"Content-Type": case.content_type, **server.auth()})


def check(case: Case, response: requests.Response) -> None:
    assert response.status_code in case.statuses, (case, response.status_code, response.text[:300])
    if case.kind == FRONTEND_413:
        return  # TorchServe's frontend refuses the body before any handler runs, with an empty 413
    try:
        body = response.json()  # every answer, error or not, is JSON
    except ValueError:
        raise AssertionError(f"not JSON: {case} -> {response.status_code} {response.text[:300]!r}") from None
    if response.status_code >= 400:
        assert body.get("error") or body.get("message"), (case.kind, body)
        return
    if case.kind != "good":
        return
    rows = body if case.path == "embed" else [item["embedding"] for item in body["data"]]
    assert len(rows) == case.inputs
    if case.path == "embed" or isinstance(rows[0], list):
        assert np.isfinite(np.array(rows, dtype=float)).all()


def test_fuzzed_bad_requests_mixed_with_good_ones(server):
    before = workers(server)
    tried: Counter = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(st.one_of(good(), bad_requests), min_size=3, max_size=8), good())
    def one_batch(cases, a_good_one):
        cases = [*cases, a_good_one]  # every batch holds a good request
        responses = concurrently([lambda c=c: send(server, c) for c in cases])
        for case, response in zip(cases, responses):
            check(case, response)
            tried[case.kind] += 1

    one_batch()
    assert workers(server) == before, "a worker restarted"
    print(f"\nfuzz: {sum(tried.values())} requests, {tried['good']} good: {dict(sorted(tried.items()))}")
    assert tried["good"] >= EXAMPLES and sum(tried.values()) - tried["good"] >= EXAMPLES


TINY = Served("tiny", DIMENSION, VOCAB_SIZE, tuple(sorted(PROMPTS)))


def test_ten_thousand_fuzzed_and_oversized_requests(server, record_property):
    """The issue's bar: >= 10,000 requests, bad, good and the largest shapes interleaved, every one
    answered with its own status, no good one lost, no worker restarted."""
    summary = run_volume(server, TINY)
    print(f"\nfuzz at volume: {json.dumps(summary)}")
    record_property("fuzz_volume", summary)
    assert summary["requests"] >= 10_000 and summary["good_answered_200"] >= 0.45 * summary["requests"]
