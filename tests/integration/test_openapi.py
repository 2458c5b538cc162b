"""The served OpenAPI document, validated, then fuzzed against the live server with schemathesis
as a new user would run it.

A real TorchServe serves the tiny model, a tiny cross-encoder and a tiny causal LM reranker (each
its own document: rerank, predict, an instruction for the causal one) with the default build's
limits; the document it serves must be valid OpenAPI 3.1 with the worker's real values, and
schemathesis generates requests for every operation from it, with the inference key, positive and
negative, every check on but three that TorchServe's design fails (each tested here instead):
every answer must be no 5xx, a status the document lists with its content type, headers and a body
matching its schema; a schema-valid request must be served, or refused with 413 over a limit no
schema can say; a schema-violating one must be refused; every 4xx must be a JSON body naming the
field at fault. TorchServe's own 413 to a body over its max_request_size (an empty body, no content
type) is the one answer taken outside the schemas. The worker is the same process at the end.
About 200 examples per operation here; `make fuzz` sets EMBEDSERVE_FUZZ_EXAMPLES higher
(docs/api.md lists what is not checked, and why)."""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter

import pytest
import requests
import schemathesis
from openapi_spec_validator import validate
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events

from tests.support.client import worker_identities
from tests.support.rerankers import make_reranker
from tests.support.serving import FLOAT32, serving

pytestmark = pytest.mark.integration

MODEL = "tiny"
RERANKER = "reranker"
# The scoring models fuzzed, by served name: a cross-encoder and a causal LM reranker (tests/support/rerankers.py).
SCORERS = {RERANKER: "bert", "llmreranker": "qwen3"}
EXAMPLES = int(os.environ.get("EMBEDSERVE_FUZZ_EXAMPLES", "200"))
# Statuses that answer no field: the route (404), the method (405), a full work budget (429).
NOT_ABOUT_A_FIELD = (404, 405, 429)
# What schemathesis sees as refusing a request: the document's 4xx statuses (413 for a limit).
REFUSALS = ["400", "405", "413", "422"]
# What schemathesis sees as accepting a schema-valid request: its defaults, and 413 for an input
# over a limit no schema can say (tokens after tokenizing, the answer's bytes, TorchServe's
# max_request_size), the documented answer to a too-large valid-looking body.
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx", "413"]
RESPONSE_TIMEOUT_S = 120  # the build's default response timeout, which these builds keep


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """The tiny model and the tiny scoring models, batching as little as they can: the fuzzer sends
    one request at a time."""
    scorers = {name: make_reranker(family, tmp_path_factory.mktemp(f"openapi-{name}") / family)
               for name, family in SCORERS.items()}
    builds = [[*FLOAT32, "--model", str(model), "--name", name, "--workers", "1", "--batch-size", "8",
               "--max-batch-delay", "1"] for name, model in {MODEL: tiny_model_dir, **scorers}.items()]
    with serving(tmp_path_factory.mktemp("openapi"), *builds) as ts:
        yield ts


def _document(served, model: str) -> dict:
    response = requests.get(f"{served.url('inference')}/predictions/{model}/1.0/openapi.json", headers=served.auth(),
                            timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def document(served):
    return _document(served, MODEL)




@pytest.fixture(scope="module")
def pids(served):
    """The workers' identities before the fuzzer starts; the last tests hold them unchanged."""
    return {model: _identities(served, model) for model in (MODEL, *SCORERS)}


@pytest.fixture(scope="module")
def api_schema(served, document):
    return _schema(served, document)




def _schema(served, document):
    config = SchemathesisConfig.from_dict({
        "base-url": served.url("inference"),
        "headers": served.auth(),
        # No example database: a clean clone has none to replay, and keeping one makes hypothesis
        # spend a quarter of the run optimising what it would store (its pareto front).
        "generation": {"mode": "all", "max-examples": EXAMPLES, "database": "none"},
        # The largest request the limits admit may take a quarter of the worker's response timeout
        # (docs/requests.md): schemathesis' default of 10 s would call it an error.
        "request-timeout": RESPONSE_TIMEOUT_S,
        "checks": {
            # Every check is on but three that TorchServe's design fails, each tested below instead.
            # TorchServe, not the handler, checks the key, and answers 400 where these two want 401
            # or 403, whatever they are told (test_a_call_without_the_key_gets_torchserve_s_400).
            "ignored_auth": {"enabled": False},
            "missing_required_header": {"enabled": False},
            # TorchServe does not tell the handler the method: a body sent with PUT or TRACE is
            # served as if POSTed, and info and openapi.json answer any method (docs/api.md).
            # Body-less calls of each method are tested below.
            "unsupported_method": {"enabled": False},
            "positive_data_acceptance": {"expected-statuses": ACCEPTED},
            "negative_data_rejection": {"expected-statuses": REFUSALS},
        },
    })
    schema = schemathesis.openapi.from_dict(document, config=config)
    limit = int(served.properties["max_request_size"])

    @schema.hook
    def filter_failure(context, failure, case, response) -> bool:
        """Every failure counts but those of TorchServe's own 413 to a body over its
        max_request_size: the documented answer, whose empty body and missing content type no
        response schema can describe beside the handler's JSON 413 of the same route."""
        return not frontend_413(response, limit) and not spans_beyond_the_schema(response) \
            and not image_beyond_the_schema(response)

    return schema


def spans_beyond_the_schema(response) -> bool:
    """Late chunking's caller spans checked against their own inputs: one list of ranges an input,
    each within its text, touching a token, fitting a window. No schema relates one field's length
    or values to another field's, so that refusal (400 naming the ranges) is a schema-valid
    request's documented answer (docs/api.md)."""
    if response.status_code not in (400, 422):
        return False
    error = _error_of(response)
    param, message = error.get("param"), error.get("message", "")
    return isinstance(param, str) and re.fullmatch(r"chunk_spans(\[\d+\]){0,2}", param) is not None and \
        "applies to" not in message


# What the server finds in an image's bytes (embedserve/handler/inputs/image.py decodes them): the
# data URI's form is the document's, what its base64 holds no schema can say; nor what fetching an
# allowed host's URL meets (inputs/image_urls.py: no answer, an error status, a redirect).
IMAGE_CONTENT = ("is not valid base64", "is not a readable", "truncated or corrupt", "max_image_bytes",
                 "max_image_pixels", "max_aspect_ratio", ": fetching ")


def image_beyond_the_schema(response) -> bool:
    """A schema-valid image item refused for its bytes: 400 or 413 naming the item (docs/api.md)."""
    if response.status_code not in (400, 413):
        return False
    message = _error_of(response).get("message", "")
    return any(words in message for words in IMAGE_CONTENT)


def _error_of(response) -> dict:
    """The handler's JSON error object of a refusal (TEI's routes: its message alone); empty for
    another body."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return {}
    if isinstance(error, str):  # TEI's shape: {"error": message, "error_type": ...}
        return {"message": error}
    return error if isinstance(error, dict) else {}


def frontend_413(response, limit: int) -> bool:
    """TorchServe's answer to a body over max_request_size (`limit` bytes), not the handler's."""
    body = response.request.body or b""
    size = len(body.encode() if isinstance(body, str) else body)
    return response.status_code == 413 and not response.content and size > limit


def test_the_document_is_valid_and_holds_the_live_values(served, document):
    validate(document)
    info = requests.get(f"{served.url('inference')}/predictions/{MODEL}/1.0/info", headers=served.auth(),
                        timeout=30).json()
    assert document["info"]["x-limits"] == {
        "dimension": info["embedding_dimension"], "max_input_length": info["max_input_length"],
        "max_inputs_per_request": info["max_client_batch_size"], "max_input_chars": info["max_input_chars"],
        "max_tokens_per_request": info["max_tokens_per_request"], "max_response_bytes": info["max_response_bytes"]}
    assert f"/predictions/{MODEL}/1.0/embed" in document["paths"]


def test_a_get_on_an_embedding_route_answers_405_naming_the_allowed_method(served):
    base = f"{served.url('inference')}/predictions/{MODEL}"
    for url in (base, f"{base}/1.0/v1/embeddings", f"{base}/1.0/embed", f"{base}/1.0/tokenize"):
        for method in ("GET", "HEAD", "PUT", "DELETE", "PATCH", "TRACE"):  # as they are sent: without a body
            response = requests.request(method, url, headers=served.auth(), timeout=30)
            assert response.status_code == 405 and response.headers["allow"] == "POST", (method, url, response.text)
        message = requests.get(url, headers=served.auth(), timeout=30).text
        assert "GET" in message and "POST" in message
    for path in ("info", "openapi.json"):  # any method
        assert requests.get(f"{base}/1.0/{path}", headers=served.auth(), timeout=30).status_code == 200


def test_a_call_without_the_key_gets_torchserve_s_400(served, document):
    for path, methods in document["paths"].items():
        for method in methods:
            response = requests.request(method, served.url("inference") + path, json={"input": "x"}, timeout=30)
            assert response.status_code == 400, (method, path)
            assert response.json()["type"] == "InvalidKeyException"
            assert "TorchServeError" in str(methods[method]["responses"]["400"])


def test_a_body_just_over_max_request_size_gets_torchserve_s_empty_413(served, document):
    """The frontend's limit, as a client meets it: a schema-valid body of max_request_size bytes
    is the handler's to answer; one byte more and TorchServe answers 413 itself, with an empty
    body and no content type, as the document's 413 says. No setting can lift it above every body
    the handler's limits admit (docs/api.md#limits)."""
    limit = int(served.properties["max_request_size"])
    path = f"/predictions/{MODEL}/1.0/v1/embeddings"
    body = _texts_of(limit, document["info"]["x-limits"]["max_input_chars"])
    headers = {"Content-Type": "application/json", **served.auth()}
    at_limit = requests.post(served.url("inference") + path, data=body, headers=headers, timeout=300)
    assert at_limit.status_code == 200, at_limit.text[:300]
    assert len(at_limit.json()["data"]) == len(json.loads(body)["input"])
    over = requests.post(served.url("inference") + path, data=body + b" ", headers=headers, timeout=300)
    assert over.status_code == 413 and over.content == b"" and "content-type" not in over.headers
    assert "max_request_size" in document["paths"][path]["post"]["responses"]["413"]["description"]


def _texts_of(size: int, chars: int) -> bytes:
    """{"input": [texts]} of exactly `size` bytes (JSON whitespace fills the rest), each text
    `chars` characters long, as many as fit."""
    text = ("embedding " * (chars // 10 + 1))[:chars]
    body = json.dumps({"input": [text] * max(1, (size - 16) // (chars + 4))}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


@schemathesis.check
def names_the_field(ctx, response, case) -> None:
    """Every 4xx of the handler comes with a JSON body that names the field at fault: `param` in
    OpenAI's shape, the field quoted in TEI's message."""
    if not 400 <= response.status_code < 500 or response.status_code in NOT_ABOUT_A_FIELD:
        return
    assert response.content, f"{response.status_code} with an empty body"  # TorchServe's 413 aside: filter_failure
    body = response.json()
    if "error" not in body:  # TorchServe's own answer, {"code", "type", "message"}: a missing key
        return
    error = body["error"]
    if isinstance(error, dict):
        assert error["param"], f"{response.status_code} without the field at fault: {error}"
    else:
        assert re.search(r"'[^']+'|\bbody\b", error), f"{response.status_code} without the field at fault: {error}"


def fuzz(schema) -> tuple[Counter, list[str], float]:
    """Every phase schemathesis runs (examples, coverage, fuzzing) on every operation: the
    requests by operation and status, the failures found, the seconds it took."""
    started = time.monotonic()
    tally: Counter = Counter()
    failures: list[str] = []
    for event in schemathesis.engine.from_schema(schema).execute():
        recorder = getattr(event, "recorder", None)
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)) and recorder is not None:
            for interaction in recorder.interactions.values():
                tally[(recorder.label, _status(interaction.response))] += 1
            for case_id, checks in recorder.checks.items():
                failures += [f"{recorder.label}: {check.name}: {check.failure_info.failure.title}: "
                             f"{check.failure_info.failure.message[:500]}\n"
                             f"{_answered(recorder.interactions.get(case_id))}\n{check.failure_info.code_sample}"
                             for check in checks if check.failure_info is not None]
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            failures.append(f"error in {getattr(event, 'label', 'the run')}: "
                            f"{getattr(event, 'value', getattr(event, 'exception', event))!r}")
    return tally, failures, time.monotonic() - started


def test_every_operation_holds_to_the_document(served, api_schema, pids):
    tally, failures, seconds = fuzz(api_schema)
    print("\n" + summary(tally, failures, seconds))
    assert not failures, "\n\n".join(dict.fromkeys(failures))  # each distinct failure once
    assert {operation for operation, _ in tally} >= {"POST /predictions/tiny", "GET /predictions/tiny/1.0/openapi.json"}
    assert _identities(served, MODEL) == pids[MODEL]  # no worker died or was replaced


@pytest.mark.parametrize("name", SCORERS)
def test_every_reranker_operation_holds_to_its_document(served, pids, name):
    document = _document(served, name)
    validate(document)
    assert {path.rsplit("/", 1)[-1] for path in document["paths"]} >= {"rerank", "predict"}
    instruction = document["components"]["schemas"]["CohereRerankRequest"]["properties"]["instruction"]
    assert ("string" in instruction["type"]) == (SCORERS[name] == "qwen3")  # only a causal reranker takes one
    tally, failures, seconds = fuzz(_schema(served, document))
    print("\n" + summary(tally, failures, seconds))
    assert not failures, "\n\n".join(dict.fromkeys(failures))
    assert {operation for operation, _ in tally} >= {f"POST /predictions/{name}/1.0/{route}" for route in
                                                      ("rerank", "predict", "v1/rerank", "v2/rerank")}
    assert _identities(served, name) == pids[name]


def _status(response) -> int | str | None:
    """The answer's status, TorchServe's own 413 (an empty body) told apart from the handler's."""
    if response is None:
        return None
    return "413 empty" if response.status_code == 413 and not response.content else response.status_code


def _answered(interaction) -> str:
    """What the server answered a failing case (the curl line shows a long body cut short)."""
    if interaction is None or interaction.response is None:
        return "no answer"
    response = interaction.response
    content_type = response.headers.get("content-type", ["none"])[0]
    return (f"answered {response.status_code} (content type {content_type}) to a body of "
            f"{interaction.request.body_size} bytes: {response.content[:300]!r}")


def summary(tally: Counter, failures: list[str], seconds: float) -> str:
    lines = [f"schemathesis: {sum(tally.values())} requests in {seconds:.0f} s, up to {EXAMPLES} generated "
             f"examples per operation and mode; {len(set(failures))} distinct failures"]
    for operation in sorted({operation for operation, _ in tally}):
        statuses = {status: n for (op, status), n in sorted(tally.items(), key=str) if op == operation}
        lines.append(f"  {operation}: {sum(statuses.values())} ({', '.join(f'{s}: {n}' for s, n in statuses.items())})")
    lines.append(f"  5xx: {sum(n for (_, status), n in tally.items() if isinstance(status, int) and status >= 500)}")
    return "\n".join(lines)


def _identities(server, name: str = MODEL) -> set[tuple]:
    return worker_identities(server, name)
