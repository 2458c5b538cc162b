"""Multi-vector (ColBERT) models through the real TorchServe, built by build_mar as a user builds
them (the build compares with MultiVectorEncoder; the default CPU engine runs the encoder in ONNX
Runtime), against sentence-transformers' MultiVectorEncoder: token vectors of queries and
documents on the native route, OpenAI's through the real `openai` client and TEI's /embed_all,
MaxSim on /rerank and on Cohere's v2/rerank through the official `cohere` client, concurrent
clients, and bad inputs beside good ones."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests

from tests.support.catalog import MULTI_VECTOR
from tests.support.model_families import corpus
from tests.support.multi_vector_models import reference_maxsim, reference_tokens

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model(catalog_models):
    return catalog_models[MULTI_VECTOR]


@pytest.fixture(scope="module")
def server(catalog):
    """The session's catalog server (tests/support/catalog.py): built as a user builds it."""
    return catalog


def post(server, route, body, status=200):
    url = f"{server.url('inference')}/predictions/colbert" + (f"/1.0/{route}" if route else "")
    response = requests.post(url, json=body, headers=server.auth(), timeout=120)
    assert response.status_code == status, response.text
    return response.json()


def assert_same_tokens(got, want):
    for row, expected in zip(got, want, strict=True):
        row = np.asarray(row)
        assert row.shape == expected.shape
        assert ((row * expected).sum(1) / np.linalg.norm(row, axis=1) / np.linalg.norm(expected, axis=1)).min() \
            >= 0.9999


def test_token_vectors_of_queries_and_documents(server, model):
    texts = corpus(32, seed=21)
    for kind in ("query", "document"):
        answer = post(server, "", {"input": texts, "input_type": kind})
        assert_same_tokens([item["embedding"] for item in answer["data"]], reference_tokens(model, texts, kind=kind))
    assert_same_tokens(post(server, "embed_all", {"inputs": texts}), reference_tokens(model, texts, kind=None))


def test_the_openai_client_gets_token_vectors(server, model):
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/colbert/1.0/v1",
                           api_key=server.keys()["inference"], max_retries=0)
    texts = corpus(6, seed=24)
    want = reference_tokens(model, texts, kind="document")
    floats = client.embeddings.create(model="colbert", input=texts, encoding_format="float",
                                      extra_body={"input_type": "document"})
    assert_same_tokens([d.embedding for d in floats.data], want)
    # Unasked, the client asks for base64 and decodes each answer into one flat list: reshaped, the same.
    flat = client.embeddings.create(model="colbert", input=texts, extra_body={"input_type": "document"})
    dimension = want[0].shape[1]
    assert_same_tokens([np.reshape(d.embedding, (-1, dimension)) for d in flat.data], want)


def test_rerank_is_maxsim_and_clients_run_concurrently(server, model):
    documents = corpus(12, seed=22)
    queries = corpus(8, seed=23)
    with ThreadPoolExecutor(8) as pool:
        rankings = list(pool.map(lambda query: post(server, "rerank", {"query": query, "texts": documents}), queries))
    for query, ranked in zip(queries, rankings):
        want = reference_maxsim(model, query, documents)
        assert max(abs(item["score"] - want[item["index"]]) for item in ranked) <= 1e-4
        assert [item["index"] for item in ranked] == sorted(range(len(documents)), key=lambda i: (-want[i], i))


def test_the_official_cohere_client_gets_maxsim(server, model):
    cohere = pytest.importorskip("cohere")
    client = cohere.ClientV2(api_key=server.auth()["Authorization"].split()[-1],
                             base_url=f"{server.url('inference')}/predictions/colbert/1.0")
    documents = corpus(10, seed=25)
    query = corpus(1, seed=26)[0]
    answer = client.rerank(model="colbert", query=query, documents=documents, top_n=3)
    want = reference_maxsim(model, query, documents)
    assert [item.index for item in answer.results] == sorted(range(len(documents)), key=lambda i: (-want[i], i))[:3]
    assert max(abs(item.relevance_score - want[item.index]) for item in answer.results) <= 1e-4


def test_bad_requests_are_their_own_4xx_beside_good_ones(server):
    bad = [("", {"input": "a", "input_type": "passage"}, 400), ("rerank", {"query": "a", "texts": []}, 400),
           ("", {"input": "word " * 300, "input_type": "document", "truncate": False}, 413),
           ("v1/embeddings", {"input": "a", "encoding_format": "hex"}, 400), ("embed", {"inputs": "a"}, 404),
           ("v2/rerank", {"query": "a", "documents": ["b"], "instruction": "rank"}, 400)]
    good = [("", {"input": ["a good text"], "input_type": "document"}, 200)] * 4
    with ThreadPoolExecutor(len(bad) + len(good)) as pool:
        statuses = list(pool.map(lambda case: requests.post(
            f"{server.url('inference')}/predictions/colbert" + (f"/1.0/{case[0]}" if case[0] else ""), json=case[1],
            headers=server.auth(), timeout=120).status_code, bad + good))
    assert statuses == [status for _, _, status in bad + good]
    info = requests.get(f"{server.url('inference')}/predictions/colbert/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["task"] == "multi_vector" and info["engine"] == "onnxruntime"
