"""Sparse (SPLADE) models through the real TorchServe, built by build_mar as a user builds them (the
build itself compares with SparseEncoder.encode), against sentence-transformers' SparseEncoder:
BERT with max pooling and XLM-R with sum pooling and log1p_relu, an inference-free model (queries
looked up), TEI's /embed_sparse, the native route and OpenAI's through the real `openai` client,
concurrent clients batched together, bad inputs one at a time and beside good ones,
the dense routes refused, the OpenAPI document valid, and the worker alive throughout."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from openapi_spec_validator import validate

from tests.support.catalog import SPARSE, SPARSE_SHAPES as SHAPES
from tests.support.model_families import corpus
from tests.support.sparse_models import assert_same_sparse, reference_sparse, served_sparse

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def models(catalog_models):
    return {name: catalog_models[name] for name in SPARSE}


@pytest.fixture(scope="module")
def server(catalog):
    """The session's catalog server (tests/support/catalog.py): built as a user builds them."""
    return catalog


def post(server, name, route, body, status=200):
    url = f"{server.url('inference')}/predictions/{name}" + (f"/1.0/{route}" if route else "")
    response = requests.post(url, json=body, headers=server.auth(), timeout=120)
    assert response.status_code == status, response.text
    return response.json()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_served_sparse_vectors_are_sparse_encoder_s(server, models, name):
    texts = corpus(64, seed=11)
    want = reference_sparse(models[name], texts)
    assert_same_sparse(served_sparse(post(server, name, "embed_sparse", {"inputs": texts})), want)
    native = post(server, name, "", {"input": texts})
    got = [dict(zip(item["embedding"]["indices"], item["embedding"]["values"])) for item in native["data"]]
    assert_same_sparse(got, want)
    assert native["usage"]["total_tokens"] > len(texts)


def test_the_openai_client_gets_sparse_vectors(server, models):
    # The client asks for base64 unless told: a sparse vector is an object either way, which it passes on.
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/splade/1.0/v1",
                           api_key=server.keys()["inference"], max_retries=0)
    texts = corpus(8, seed=14)
    want = reference_sparse(models["splade"], texts)
    for encoding in ({}, {"encoding_format": "float"}):
        result = client.embeddings.create(model="splade", input=texts, **encoding)
        assert [d.object for d in result.data] == ["sparse_embedding"] * len(texts)
        assert_same_sparse([dict(zip(d.embedding["indices"], d.embedding["values"])) for d in result.data], want)
    top = client.embeddings.create(model="splade", input=texts[0], extra_body={"max_active_dims": 2}).data[0]
    assert len(top.embedding["indices"]) == 2
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="splade", input="a", extra_body={"encoding_format": "hex"})
    assert refused.value.body["param"] == "encoding_format"


def test_an_inference_free_model_s_queries_and_documents(server, models):
    texts = corpus(32, seed=13)
    for kind in ("query", "document"):
        got = served_sparse(post(server, "splade-free", "embed_sparse", {"inputs": texts, "input_type": kind}))
        assert_same_sparse(got, reference_sparse(models["splade-free"], texts, kind=kind))
    info = requests.get(f"{server.url('inference')}/predictions/splade-free/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["modules"][0] == "SparseStaticEmbedding(queries)"


def test_concurrent_clients_each_get_their_own_vectors(server, models):
    texts = corpus(48, seed=12)
    want = reference_sparse(models["splade"], texts)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda text: post(server, "splade", "embed_sparse", {"inputs": text}), texts))
    assert_same_sparse([served_sparse(answer)[0] for answer in answers], want)


def test_options_and_formats(server):
    text = "the quick brown fox jumps over the lazy dog"
    top = post(server, "splade", "", {"input": text, "max_active_dims": 3})["data"][0]["embedding"]
    assert len(top["indices"]) == 3 and top["indices"] == sorted(top["indices"])
    tokens = post(server, "splade", "", {"input": text, "sparse_format": "tokens"})["data"][0]["embedding"]
    assert tokens and all(isinstance(key, str) and value > 0 for key, value in tokens.items())


def test_bad_requests_are_their_own_4xx_beside_good_ones(server):
    bad = [("", {"input": "a", "threshold": -1}, 400), ("", {"input": [[1, 2]]}, 400),
           ("embed_sparse", {"inputs": []}, 400), ("", {"input": "a " * 300, "truncate": False}, 413),
           ("v1/embeddings", {"input": "a", "model": 3}, 400), ("embed", {"inputs": "a"}, 404)]
    good = [("embed_sparse", {"inputs": ["a good text"]}, 200)] * 5
    with ThreadPoolExecutor(len(bad) + len(good)) as pool:
        statuses = list(pool.map(lambda case: requests.post(
            f"{server.url('inference')}/predictions/splade" + (f"/1.0/{case[0]}" if case[0] else ""), json=case[1],
            headers=server.auth(), timeout=120).status_code, bad + good))
    assert statuses == [status for _, _, status in bad + good]
    assert post(server, "splade", "embed_sparse", {"inputs": "still serving"})


def test_info_and_openapi_list_the_sparse_routes(server):
    info = requests.get(f"{server.url('inference')}/predictions/splade/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["task"] == "sparse" and info["routes"] == ["", "v1/embeddings", "embed_sparse"]
    assert info["engine"] == "torch" and info["model_dtype"] == "float32"
    document = requests.get(f"{server.url('inference')}/predictions/splade/1.0/openapi.json",
                            headers=server.auth(), timeout=60).json()
    validate(document)
    assert {"/predictions/splade/1.0/embed_sparse", "/predictions/splade/1.0/v1/embeddings"} <= set(document["paths"])
