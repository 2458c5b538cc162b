"""Hybrid (bge-m3) models through the real TorchServe, built by build_mar as a user builds them
(the build converts the .pt heads and compares all three outputs with FlagEmbedding), against
FlagEmbedding's BGEM3: the dense, sparse and ColBERT outputs on the native route, the official
`openai` client with and without `outputs` in extra_body, concurrent clients asking for different
outputs, bad requests beside good ones, and what /info and the OpenAPI document say.

The default CPU engine of this model is ONNX Runtime in float32 (the build exports the encoder;
the heads run in torch float32 after it): /info says so, and the bars below hold for it."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests
from openapi_spec_validator import validate

from tests.support.catalog import HYBRID
from tests.support.m3_models import reference_m3
from tests.support.model_families import corpus
from tests.support.sparse_models import assert_same_sparse, served_sparse

pytestmark = pytest.mark.integration

ALL = ["dense", "sparse", "colbert"]
TEXTS = corpus(46, seed=13) + ["a", "hello world " * 60]  # one text over the max length: cut alike
MIN_DENSE_COSINE = 0.99999
MIN_COLBERT_COSINE = 0.9999


@pytest.fixture(scope="module")
def model(catalog_models):
    return catalog_models[HYBRID]


@pytest.fixture(scope="module")
def server(catalog):
    """The session's catalog server (tests/support/catalog.py): built as a user builds it."""
    return catalog


@pytest.fixture(scope="module")
def reference(model):
    return reference_m3(model, TEXTS)


def post(server, route, body, status=200):
    url = f"{server.url('inference')}/predictions/m3" + (f"/1.0/{route}" if route else "")
    response = requests.post(url, json=body, headers=server.auth(), timeout=120)
    assert response.status_code == status, response.text
    return response.json()


def cosines(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)


def item_sparse(item):
    return dict(zip(item["sparse_embedding"]["indices"], item["sparse_embedding"]["values"]))


def assert_same_item(item, reference, i):
    """An answer item against FlagEmbedding's outputs of text i, for whatever the item holds."""
    if "embedding" in item:
        assert cosines(item["embedding"], reference["dense"][i]) >= MIN_DENSE_COSINE, i
    if "sparse_embedding" in item:
        assert_same_sparse([item_sparse(item)], [reference["sparse"][i]])
    if "colbert_embedding" in item:
        rows = item["colbert_embedding"]
        rows = np.frombuffer(base64.b64decode(rows), "<f4").reshape(-1, 32) if isinstance(rows, str) else rows
        rows = np.asarray(rows, dtype=np.float64)
        assert rows.shape == reference["colbert"][i].shape, i
        assert cosines(rows, reference["colbert"][i]).min() >= MIN_COLBERT_COSINE, i


def test_served_outputs_are_flag_embedding_s(server, reference):
    answer = post(server, "", {"input": TEXTS, "outputs": ALL})
    assert [set(item) for item in answer["data"]] == [{"object", "index", "embedding", "sparse_embedding",
                                                       "colbert_embedding"}] * len(TEXTS)
    for i, item in enumerate(answer["data"]):
        assert_same_item(item, reference, i)
    assert_same_sparse(served_sparse(post(server, "embed_sparse", {"inputs": TEXTS})), reference["sparse"])
    assert cosines(post(server, "embed", {"inputs": TEXTS}), reference["dense"]).min() >= MIN_DENSE_COSINE


def test_the_openai_client_gets_dense_vectors_and_the_outputs_it_asks_for(server, reference):
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/m3/1.0/v1",
                           api_key=server.keys()["inference"], max_retries=0)
    texts = TEXTS[:4]
    plain = client.embeddings.create(model="m3", input=texts)  # the client asks for base64
    assert cosines([d.embedding for d in plain.data], reference["dense"][:4]).min() >= MIN_DENSE_COSINE
    assert all(not d.model_extra for d in plain.data)  # OpenAI's answer, nothing more

    # the client's default base64 decodes `embedding` only: colbert_embedding stays base64 (float32, row-major)
    for encoding in ({}, {"encoding_format": "float"}):
        result = client.embeddings.create(model="m3", input=texts, extra_body={"outputs": ALL}, **encoding)
        for i, d in enumerate(result.data):
            assert isinstance(d.model_extra["colbert_embedding"], str if not encoding else list)
            assert set(d.model_extra) == {"sparse_embedding", "colbert_embedding"}
            assert_same_item({"embedding": d.embedding, **d.model_extra}, reference, i)

    raw = client.embeddings.with_raw_response.create(model="m3", input=texts, encoding_format="float",
                                                     extra_body={"outputs": ["sparse"], "max_active_dims": 2})
    items = raw.http_response.json()["data"]
    assert all(set(item) == {"object", "index", "sparse_embedding"} for item in items)
    assert all(len(item["sparse_embedding"]["indices"]) <= 2 for item in items)
    sparse_only = client.embeddings.create(model="m3", input=texts, extra_body={"outputs": ["sparse"]})
    for i, d in enumerate(sparse_only.data):  # no `embedding` to decode: the client passes the item on
        assert_same_sparse([item_sparse(d.model_extra)], [reference["sparse"][i]])


def test_concurrent_requests_mixing_outputs_each_get_their_own(server, reference):
    choices = [["dense"], ["sparse"], ["colbert"], ALL, ["sparse", "colbert"]]
    cases = [(i, choices[i % len(choices)]) for i in range(len(TEXTS))]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda case: post(server, "", {"input": [TEXTS[case[0]]], "outputs": case[1]}),
                                cases))
    for (i, outputs), answer in zip(cases, answers):
        [item] = answer["data"]
        keys = {"dense": "embedding", "sparse": "sparse_embedding", "colbert": "colbert_embedding"}
        assert set(item) == {"object", "index", *(keys[name] for name in outputs)}
        assert_same_item(item, reference, i)


def test_bad_requests_are_their_own_4xx_beside_good_ones(server, reference):
    bad = [("", {"input": "a", "outputs": []}, 400), ("", {"input": "a", "outputs": ["dense", "dense"]}, 400),
           ("v1/embeddings", {"input": "a", "outputs": [1]}, 400), ("", {"inputs": "a", "outputs": ["sparse"]}, 400),
           ("", {"input": "a", "outputs": ALL, "threshold": -1}, 400),
           ("", {"input": "a " * 300, "outputs": ALL, "truncate": False}, 413),
           ("similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, 404)]
    good = [("", {"input": [TEXTS[i]], "outputs": ALL}, 200) for i in range(6)]
    with ThreadPoolExecutor(len(bad) + len(good)) as pool:
        responses = list(pool.map(lambda case: requests.post(
            f"{server.url('inference')}/predictions/m3" + (f"/1.0/{case[0]}" if case[0] else ""), json=case[1],
            headers=server.auth(), timeout=120), bad + good))
    assert [response.status_code for response in responses] == [status for _, _, status in bad + good]
    for response in responses[:5]:
        assert "outputs" in response.text or "threshold" in response.text
    for i, response in enumerate(responses[len(bad):]):
        assert_same_item(response.json()["data"][0], reference, i)
    assert post(server, "", {"input": "still serving", "outputs": ALL})["data"][0]["colbert_embedding"]


def test_info_and_openapi_say_hybrid_on_onnx_runtime_float32(server):
    info = requests.get(f"{server.url('inference')}/predictions/m3/1.0/info", headers=server.auth(), timeout=60).json()
    assert info["task"] == "hybrid" and info["routes"] == ["", "v1/embeddings", "embed", "embed_sparse"]
    # the default CPU engine: the build's ONNX export of the encoder, in float32
    assert info["engine"] == "onnxruntime" and info["model_dtype"] == "float32"
    assert info["modules"][-2:] == ["SparseLinear(relu, max by token id)", "ColBERTLinear(32, normalized)"]
    document = requests.get(f"{server.url('inference')}/predictions/m3/1.0/openapi.json", headers=server.auth(),
                            timeout=60).json()
    validate(document)
    assert "/predictions/m3/1.0/embed_sparse" in document["paths"]
    body = document["paths"]["/predictions/m3"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "outputs" in str(body)
