"""Through the real TorchServe, as users call it. One server per session (see conftest)."""

import base64
import json
import time
import uuid
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from tests.support.client import (concurrently, metric_growth, metric_samples_after, predict,
                                  settled_metric_samples, vectors)
from tests.support.engines import TEXTS, make_engine
from tests.support.serving import TINY_BATCH_SIZE

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = make_engine(tiny_model_dir)

    def embed(texts):
        from embedserve.handler.api.exchange import RawRequest

        [response] = engine.handle([RawRequest({"input": list(texts)})])
        return np.array([d["embedding"] for d in json.loads(response.body)["data"]])

    return embed


def test_concurrent_requests_are_batched_and_correct(server, reference):
    texts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(16)]
    responses = concurrently([lambda t=t: predict(server, {"input": t}) for t in texts])
    for text, response in zip(texts, responses):
        np.testing.assert_allclose(vectors(response)[0], reference([text])[0], atol=1e-5)
    batch_sizes = [int(r.headers["x-batch-size"]) for r in responses]
    assert max(batch_sizes) > 1, batch_sizes
    assert max(batch_sizes) <= TINY_BATCH_SIZE


def test_native_response_shape(server, reference):
    response = predict(server, {"input": TEXTS})
    body = response.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(TEXTS)
    np.testing.assert_allclose(vectors(response), reference(TEXTS), atol=1e-5)


def test_text_plain_body(server, reference):
    response = predict(server, "Ünïcode: 漢字 日本語".encode(), content_type="text/plain; charset=utf-8")
    np.testing.assert_allclose(vectors(response)[0], reference(["Ünïcode: 漢字 日本語"])[0], atol=1e-5)


def test_bad_request_fails_alone_in_its_batch(server, reference):
    good = [f"good text {i}" for i in range(7)]
    for _ in range(3):  # retried only if the scheduler split them into separate batches
        calls = [lambda t=t: predict(server, {"input": [t]}) for t in good]
        calls.insert(3, lambda: predict(server, b'{"input": ["unterminated'))
        responses = concurrently(calls)
        bad = responses.pop(3)
        if int(bad.headers["x-batch-size"]) > 1:
            break
    assert int(bad.headers["x-batch-size"]) > 1, "the bad request never shared a batch"
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "body" and "not valid JSON" in error["message"]
    assert error["type"] == "invalid_request_error"
    for text, response in zip(good, responses):
        np.testing.assert_allclose(vectors(response)[0], reference([text])[0], atol=1e-5)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": []}, 400, "input"),
        ({"input": [[1, "a"]]}, 400, "input[0][1]"),
        ({"input": [True]}, 400, "input[0]"),
        ({"text": "x"}, 400, "input"),
        ({"input": "x", "dimensions": 999}, 400, "dimensions"),
    ],
)
def test_malformed_requests_get_their_4xx(server, body, status, param):
    response = predict(server, body)
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == param


def test_unknown_route_is_404(server):
    response = predict(server, {"input": "x"}, path="v2/whatever")
    assert response.status_code == 404
    assert "unknown route" in response.json()["error"]["message"]


def test_form_encoded_body_explains_itself(server):
    url = f"{server.url('inference')}/predictions/tiny"
    response = requests.post(url, data={"input": "x"}, headers=server.auth(), timeout=30)
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]


def openai_client(server, model="tiny"):
    return openai.OpenAI(base_url=f"{server.url('inference')}/predictions/{model}/1.0/v1",
                         api_key=server.keys()["inference"], max_retries=0)


def test_openai_client(server, reference):
    client = openai_client(server)
    result = client.embeddings.create(model="tiny", input=TEXTS[:3])  # the client asks for base64
    got = np.array([d.embedding for d in result.data])
    np.testing.assert_allclose(got, reference(TEXTS[:3]), atol=1e-5)
    assert result.usage.prompt_tokens > 3

    floats = client.embeddings.create(model="tiny", input="hello world", encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, reference(["hello world"])[0], atol=1e-5)

    short = client.embeddings.create(model="tiny", input=["hello world"], dimensions=8)
    assert len(short.data[0].embedding) == 8
    assert np.linalg.norm(short.data[0].embedding) == pytest.approx(1.0, abs=1e-5)

    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny", input=[])
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "input"


def test_openai_client_with_a_wrong_key_is_refused(server):
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/tiny/1.0/v1",
                           api_key="wrong", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(model="tiny", input=["x"])
    assert caught.value.status_code == 400  # TorchServe answers 400 for a bad token


def test_requests_without_the_key_are_refused(server):
    inference = requests.post(f"{server.url('inference')}/predictions/tiny", json={"input": "x"}, timeout=30)
    assert inference.status_code == 400 and "Token Authorization failed" in inference.text
    management = requests.get(f"{server.url('management')}/models", timeout=30)
    assert management.status_code == 400 and "Token Authorization failed" in management.text


def test_registering_models_is_refused(server):
    response = requests.post(f"{server.url('management')}/models?url=http://example.com/x.mar",
                             headers=server.auth("management"), timeout=30)
    assert response.status_code == 405


def describe(server, model):
    response = requests.get(f"{server.url('management')}/models/{model}", headers=server.auth("management"),
                            timeout=30)
    response.raise_for_status()
    return response.json()[0]


def test_management_api_scales_workers(server, reference):
    assert len(describe(server, "tiny")["workers"]) == 1
    url = f"{server.url('management')}/models/tiny"
    try:
        response = requests.put(f"{url}?min_worker=2&synchronous=true", headers=server.auth("management"),
                                timeout=300)
        assert response.status_code == 200, response.text
        workers = describe(server, "tiny")["workers"]
        assert len(workers) == 2 and all(w["status"] == "READY" for w in workers)
        responses = concurrently([lambda: predict(server, {"input": "hello world"}) for _ in range(8)])
        for response in responses:
            np.testing.assert_allclose(vectors(response)[0], reference(["hello world"])[0], atol=1e-5)
    finally:
        requests.put(f"{url}?min_worker=1&max_worker=1&synchronous=true", headers=server.auth("management"),
                     timeout=300)
    assert len(describe(server, "tiny")["workers"]) == 1


def test_prometheus_metrics_are_exposed(server):
    predict(server, {"input": "count me"})
    text = requests.get(f"{server.url('metrics')}/metrics", timeout=30).text
    assert 'ts_inference_requests_total{model_name="tiny"' in text
    # TorchServe's own metric of each batch, which the worker's own loop records as TorchServe's did.
    assert any(line.startswith("PredictionTime{") and 'ModelName="tiny"' in line for line in text.splitlines())


# What each request below should get, from either worker loop: (body, content type, path, GET?).
LOOP_CASES = [
    ({"input": ["loop one", "loop two"]}, "application/json", "", False),
    ("a plain text \u00e9t\u00e9", "text/plain", "", False),
    ({"input": "openai shape", "model": "tiny"}, "application/json", "v1/embeddings", False),
    ({"inputs": "tei shape"}, "application/json", "embed", False),
    (b'{"input": "unterminated', "application/json", "", False),
    (b'"a json string"', "application/json", "", False),
    (b"null", "application/json", "", False),
    ({"input": ["text", 3]}, "application/json", "", False),
    ({"input": "x"}, "application/json", "no/such/route", False),
    (None, None, "info", True),
]


def _loop_answer(server, model, body, content_type, path, get):
    url = f"{server.url('inference')}/predictions/{model}" + (f"/1.0/{path}" if path else "")
    if get:
        return requests.get(url, headers=server.auth(), timeout=60)
    data = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return requests.post(url, data=data, headers={"Content-Type": content_type, **server.auth()}, timeout=60)


def test_the_worker_s_own_loop_answers_as_torchserve_s_loop(server):
    """tiny's worker reads and answers its batches itself from its second batch on (the default,
    own_worker_loop); tinypacked's stays in TorchServe's loop. Each request, alone and in one
    concurrent batch, gets the same status, headers and answer from both."""
    for model in ("tiny", "tinypacked"):  # past each worker's first batch
        predict(server, {"input": "first"}, model=model)
    alone = {model: [_loop_answer(server, model, *case) for case in LOOP_CASES] for model in ("tiny", "tinypacked")}
    together = {model: concurrently([lambda case=case, model=model: _loop_answer(server, model, *case)
                                     for case in LOOP_CASES]) for model in ("tiny", "tinypacked")}
    for answers in (alone, together):
        for case, ours, theirs in zip(LOOP_CASES, answers["tiny"], answers["tinypacked"]):
            assert ours.status_code == theirs.status_code, case
            assert ours.headers["content-type"] == theirs.headers["content-type"], case
            assert {h for h in ours.headers if h.startswith(("x-", "retry", "allow", "server-timing"))} == \
                {h for h in theirs.headers if h.startswith(("x-", "retry", "allow", "server-timing"))}, case
            if ours.status_code != 200:
                assert ours.json() == theirs.json(), case
            elif case[2] == "info":  # the two models differ in name and packing
                assert ours.json().keys() == theirs.json().keys()
            else:
                assert np.allclose(vectors(ours) if case[2] != "embed" else ours.json(),
                                   vectors(theirs) if case[2] != "embed" else theirs.json(), atol=1e-5), case
    assert alone["tiny"][0].status_code == 200 and {r.status_code for r in alone["tiny"][4:9]} == {400, 404}
    time.sleep(2)  # the frontend writes its logs asynchronously
    lines = [line for path in server.logs.rglob("*.log") for line in path.read_text(errors="replace").splitlines()
             if "reads and answers its batches itself" in line]
    assert any("-tiny_" in line for line in lines) and not any("-tinypacked_" in line for line in lines), lines


# --- TEI routes, options and limits through the real server -------------------------------------

def test_tei_body_on_embed_and_on_the_bare_route(server, reference):
    for path in ("embed", ""):
        response = predict(server, {"inputs": TEXTS[:3]}, path=path)
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(np.array(response.json()), reference(TEXTS[:3]), atol=1e-5)


def test_tei_errors_have_tei_shape_and_422(server):
    response = predict(server, {"inputs": "x", "prompt_name": "nope"}, path="embed")
    assert response.status_code == 422
    assert response.json() == {"error": "unknown 'prompt_name' 'nope'; known: document, query",
                               "error_type": "Validation"}


def test_info_answers_get_and_post(server):
    url = f"{server.url('inference')}/predictions/tiny/1.0/info"
    for method in (requests.get, requests.post):
        response = method(url, headers=server.auth(), timeout=30)
        assert response.status_code == 200, response.text
        info = response.json()
        assert info["served_model_name"] == "tiny" and info["embedding_dimension"] == 32
        assert info["max_input_length"] == 48 and info["model_id"] == "model"
        assert info["revision"].startswith("sha256:")


def test_tokenize(server):
    response = predict(server, {"inputs": ["hello world"]}, path="tokenize")
    assert response.status_code == 200
    [tokens] = response.json()
    assert [t["text"] for t in tokens] == ["[CLS]", "hello", "world", "[SEP]"]
    assert [(t["start"], t["stop"]) for t in tokens[1:3]] == [(0, 5), (6, 11)]


def test_openai_client_base64_with_dimensions_and_quantized_output(server, reference):
    client = openai_client(server)
    result = client.embeddings.create(model="tiny", input=["hello world", "the cat"], encoding_format="base64",
                                      dimensions=16)
    full = reference(["hello world", "the cat"])
    # The reference is normalized over 32 dimensions; re-normalize its first 16 to compare.
    want = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    # Asked for explicitly, base64 comes back as the string OpenAI sends: little-endian float32.
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in result.data])
    np.testing.assert_allclose(decoded, want, atol=1e-5)
    packed = client.embeddings.create(model="tiny", input=["hello world"], encoding_format="float",
                                      extra_body={"output_dtype": "ubinary"})
    assert packed.data[0].embedding == np.packbits(full[0] > 0).tolist()


@pytest.mark.parametrize("output_dtype", ["float", "int8", "uint8", "binary", "ubinary"])
def test_openai_client_default_base64_decodes_to_what_float_gives(server, output_dtype):
    # The client asks for base64 unless told otherwise and decodes it as float32, whatever the
    # output dtype: codes must come back as the same numbers as JSON gives them.
    client = openai_client(server)
    texts = ["hello world", "the cat"]
    extra = {"output_dtype": output_dtype}
    default = client.embeddings.create(model="tiny", input=texts, extra_body=extra)
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float", extra_body=extra)
    got = np.array([d.embedding for d in default.data], dtype=np.float32)
    want = np.array([d.embedding for d in floats.data], dtype=np.float32)  # JSON's shortest float32, exactly
    assert got.shape == (2, 4 if output_dtype.endswith("binary") else 32)
    np.testing.assert_array_equal(got, want)


def test_prompt_name_through_the_server(server, reference):
    response = predict(server, {"input": ["the cat"], "prompt_name": "query"})
    np.testing.assert_allclose(vectors(response)[0], reference(["query: the cat"])[0], atol=1e-5)


def test_sixteen_concurrent_requests_one_bad(server, reference):
    texts = [f"concurrent text {i}" for i in range(15)]
    calls = [lambda t=t: predict(server, {"input": t}) for t in texts]
    calls.insert(7, lambda: predict(server, b'{"input": ["ok", 42]}'))
    responses = concurrently(calls)
    bad = responses.pop(7)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[1]"
    for text, response in zip(texts, responses):
        np.testing.assert_allclose(vectors(response)[0], reference([text])[0], atol=1e-5)


def test_two_thousand_texts_in_one_request(server, reference):
    texts = [f"{TEXTS[i % len(TEXTS)]} number {i}" for i in range(2000)]
    response = predict(server, {"input": texts})
    got = vectors(response)
    assert got.shape == (2000, 32)
    assert [d["index"] for d in response.json()["data"]] == list(range(2000))
    sample = list(range(0, 2000, 111))
    np.testing.assert_allclose(got[sample], reference([texts[i] for i in sample]), atol=1e-5)


def test_invalid_utf8_and_too_long_inputs(server):
    response = predict(server, b"\xc3\x28 broken", content_type="text/plain")
    assert response.status_code == 400 and "UTF-8" in response.json()["error"]["message"]
    response = predict(server, {"input": ["fine", "token " * 200], "truncate": False})
    assert response.status_code == 413 and response.json()["error"]["param"] == "input[1]"
    response = predict(server, {"input": [[1, 2, 99999]]}, path="v1/embeddings")
    assert response.status_code == 400 and response.json()["error"]["param"] == "input[0][2]"


def test_body_over_max_request_size_is_413(server):
    limit = int(server.properties["max_request_size"])
    response = predict(server, {"input": "x" * (limit + 1)})
    assert response.status_code == 413


def test_request_text_never_reaches_the_logs(server):
    canary = f"canary-{uuid.uuid4().hex}"
    predict(server, {"input": [f"{canary} good"]})
    predict(server, {"inputs": [f"{canary} tei"]}, path="embed")
    predict(server, f'{{"input": ["{canary} unterminated'.encode())
    predict(server, {"input": [f"{canary} bad", 3]})
    predict(server, {"input": "x" * 10, "prompt_name": canary})
    predict(server, f"{canary} plain".encode(), content_type="text/plain")
    time.sleep(2)  # the frontend writes its logs asynchronously
    logs = {p: p.read_text(errors="replace") for p in server.logs.rglob("*") if p.is_file()}
    assert any("/predictions/tiny" in text for text in logs.values())  # the requests were logged, bodies not
    assert [str(p) for p, text in logs.items() if canary in text] == []


def test_the_frontend_logs_each_request_once_and_no_line_a_batch(server):
    """serverctl starts TorchServe with embedserve/scripts/log4j2.xml: each request in access_log.log
    alone, none of TorchServe's lines a batch or a request in ts_log.log, each of its lines once."""
    access = server.logs / "access_log.log"
    before, samples = access.read_text().count("/predictions/tiny "), settled_metric_samples(server)
    for text in TEXTS[:5]:
        assert predict(server, {"input": text}).status_code == 200
    time.sleep(2)  # the frontend writes its logs asynchronously
    assert access.read_text().count("/predictions/tiny ") == before + 5
    ts_log = (server.logs / "ts_log.log").read_text()
    assert ts_log.count("Torchserve version:") == 1  # once: not also through the root logger
    for per_batch in ("ACCESS_LOG", "result=[METRICS]", "Looping backend response", "Backend response time",
                      "Sending response for jobId", "Flushing req.cmd"):
        assert per_batch not in ts_log, per_batch
    # The metric lines it no longer copies into ts_log.log still reach Prometheus.
    assert metric_growth(samples, metric_samples_after(server, samples, 5), "EmbedRequests") >= 5


def test_the_served_archives_hold_no_pickle(server):
    from embedserve.archive.build import pickled_members

    store = Path(server.properties["model_store"])
    mars = sorted(store.glob("*.mar"))
    assert {m.name for m in mars} >= {"tiny.mar", "minilm.mar"}
    assert all(pickled_members(mar) == [] for mar in mars)


def test_handler_metrics_reach_prometheus(server):
    before = settled_metric_samples(server)
    responses = concurrently([lambda i=i: predict(server, {"input": [f"metric text {i}", "hello world"]})
                              for i in range(6)] + [lambda: predict(server, {"input": []})])
    assert [r.status_code for r in responses] == [200] * 6 + [400]
    after = metric_samples_after(server, before, requests=7)

    def grown(name, label=""):
        return metric_growth(before, after, name, label)

    assert grown("EmbedRequests") == 7
    assert grown("EmbedInputs") == 12
    assert 1 <= grown("EmbedBatches") <= 7
    assert grown("EmbedForwardPasses") >= 1
    assert 0 < grown("EmbedRealTokens") <= grown("EmbedPaddedTokens")
    assert grown("EmbedModelMs") > 0 and grown("EmbedPrepareMs") > 0 and grown("EmbedEncodeMs") > 0
    assert grown("EmbedBatchSeconds_count") == grown("EmbedBatches") and grown("EmbedBatchSeconds_sum") > 0
    assert grown("EmbedBatchSeconds_bucket", 'le="+Inf"') == grown("EmbedBatches")
    assert grown("EmbedResponses", 'Status="200"') == 6 and grown("EmbedResponses", 'Status="400"') == 1


def test_packed_passes_serve_the_padded_vectors(server, reference):
    """A build with `--set packed=true`: /info names the layout, and concurrent requests of mixed
    lengths, batched together, get the padded engine's vectors."""
    info = requests.get(f"{server.url('inference')}/predictions/tinypacked/1.0/info", headers=server.auth(), timeout=30)
    assert info.status_code == 200 and info.json()["layout"] == "packed", info.text
    assert info.json()["engine"] == "torch" and info.json()["attention"] == "grouped_sdpa"
    assert info.json()["cuda_graphs"] == 0  # a CPU worker replays none
    bodies = [[TEXTS[i % len(TEXTS)] * (1 + i % 3)] for i in range(12)]
    responses = concurrently([lambda body=body: predict(server, {"input": body}, model="tinypacked")
                              for body in bodies])
    for body, response in zip(bodies, responses):
        ours, expected = vectors(response), reference(body)
        assert (ours * expected).sum(axis=1).min() >= 0.9999
