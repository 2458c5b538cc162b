"""Rerankers and classifiers through the real TorchServe, built by build_mar as a user builds them
(the build itself compares its scores with CrossEncoder.predict), against sentence-transformers'
CrossEncoder.predict: every family (cross-encoders, a classifier, a causal LM reranker with its
chat template and instruction), every scoring route (TEI's /rerank and /predict, Cohere's and
Jina's v1/v2 rerank, the official `cohere` client), their bad inputs one request at a time and
mixed in one batch with good ones, and the routes of the other task refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from tests.support.client import metric_growth, metric_samples_after, settled_metric_samples
from tests.support.fuzz import workers
from tests.support.rerankers import LABELS, PAIRS, RERANKERS, make_reranker, reference_scores
from tests.support.serving import serving

pytestmark = pytest.mark.integration

MAX_SCORE_DIFFERENCE = 1e-4
RERANKING = [family for family in RERANKERS if family != "classifier"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerankers")
    return {family: make_reranker(family, root / family) for family in RERANKERS}


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    # As a user builds them: no options but the model, one worker each; a small input limit to test it.
    builds = [["--model", str(path), "--name", family, "--workers", "1", "--batch-size", "8",
               "--max-batch-delay", "50"] for family, path in models.items()]
    builds[0] += ["--set", "max_inputs_per_request=1500"]
    with serving(tmp_path_factory.mktemp("rerankers-torchserve"), *builds) as ts:
        yield ts


def post(server, family, route, body, status=200):
    response = requests.post(f"{server.url('inference')}/predictions/{family}/1.0/{route}", json=body,
                             headers=server.auth(), timeout=120)
    assert response.status_code == status, response.text
    return response.json()


@pytest.mark.parametrize("family", RERANKING)
def test_rerank_scores_equal_cross_encoder_predict(server, models, family):
    want = reference_scores(models[family])
    got = post(server, family, "predict", {"inputs": [list(pair) for pair in PAIRS]})
    assert [len(row) for row in got] == [1] * len(PAIRS)
    assert np.abs(np.array([row[0]["score"] for row in got]) - want).max() <= MAX_SCORE_DIFFERENCE

    # One query against many documents: TEI's /rerank and Cohere's and Jina's, best first.
    query, documents = PAIRS[0][0], [document for _, document in PAIRS]
    want = reference_scores(models[family], [(query, document) for document in documents])
    ranking = list(np.argsort(-want, kind="stable"))
    tei = post(server, family, "rerank", {"query": query, "texts": documents, "return_text": True})
    assert [item["index"] for item in tei] == ranking
    assert all(item["text"] == documents[item["index"]] for item in tei)
    assert np.abs(np.array([item["score"] for item in tei]) - want[ranking]).max() <= MAX_SCORE_DIFFERENCE
    raw = post(server, family, "rerank", {"query": query, "texts": documents, "raw_scores": True})
    logits = reference_scores(models[family], [(query, document) for document in documents],
                              activation_fn=__import__("torch").nn.Identity())
    assert np.abs(np.array([item["score"] for item in raw]) - logits[ranking]).max() <= MAX_SCORE_DIFFERENCE
    for route in ("v1/rerank", "v2/rerank"):
        answer = post(server, family, route, {"model": family, "query": query,
                                              "documents": [{"text": documents[0]}, *documents[1:]],
                                              "top_n": 3, "return_documents": True})
        assert [item["index"] for item in answer["results"]] == ranking[:3]
        assert answer["results"][0]["document"] == {"text": documents[ranking[0]]}
        assert answer["meta"]["api_version"]["version"] == route[1] and answer["usage"]["total_tokens"] > 0


def test_a_causal_reranker_takes_an_instruction_and_pairs_only(server, models):
    """The Qwen3-Reranker shape: the instruction rides in its chat template, as CrossEncoder.predict's
    prompt; a single text has no pair to render (its own 422); bad instructions are their own 4xx
    in a batch shared with good requests, and the worker stays."""
    before = workers(server, "qwen3")
    query, documents = PAIRS[0][0], [document for _, document in PAIRS]
    instruction = "Given a greeting, find the replies"
    want = reference_scores(models["qwen3"], [(query, document) for document in documents], prompt=instruction)
    answer = post(server, "qwen3", "v2/rerank", {"query": query, "documents": documents, "instruction": instruction})
    got = {item["index"]: item["relevance_score"] for item in answer["results"]}
    assert np.abs(np.array([got[i] for i in range(len(documents))]) - want).max() <= MAX_SCORE_DIFFERENCE
    assert [item["index"] for item in answer["results"]] == list(np.argsort(-want, kind="stable"))
    info = requests.get(f"{server.url('inference')}/predictions/qwen3/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["task"] == "rerank" and info["pooling"] == "last_token" and info["engine"] == "onnxruntime"
    assert any(module.startswith("LogitScore") for module in info["modules"])
    bad = [("predict", {"inputs": [["q", "a"], "one text"]}, 422, "inputs[1]"),
           ("v1/rerank", {"query": "q", "documents": ["a"], "instruction": 3}, 400, "instruction"),
           ("v1/rerank", {"query": "q", "documents": ["a"], "instruction": "x" * 100_001}, 413, "instruction"),
           ("rerank", {"query": "q", "texts": ["a " * 400], "truncate": False}, 413, "texts[0]")]
    with ThreadPoolExecutor(8) as pool:
        futures = [(case, pool.submit(requests.post, f"{server.url('inference')}/predictions/qwen3/1.0/{case[0]}",
                                      json=case[1], headers=server.auth(), timeout=120)) for case in bad]
        goods = [pool.submit(requests.post, f"{server.url('inference')}/predictions/qwen3/1.0/rerank",
                             json={"query": query, "texts": documents}, headers=server.auth(), timeout=120)
                 for _ in range(8)]
    for (route, body, status, field), future in futures:
        response = future.result()
        assert response.status_code == status and field in response.text, (route, response.text)
    assert all(future.result().status_code == 200 for future in goods)
    assert workers(server, "qwen3") == before


def test_a_thousand_documents_come_back_in_order(server, models):
    query = "fast model server"
    documents = [f"document {i} " + "batch request token " * (i % 17) for i in range(1000)]
    want = reference_scores(models["bert"], [(query, document) for document in documents])
    got = post(server, "bert", "rerank", {"query": query, "texts": documents})
    # Best first, every document once, each its own score: the ranking is CrossEncoder's up to
    # scores closer than the tolerance.
    assert sorted(item["index"] for item in got) == list(range(1000))
    assert all(a["score"] >= b["score"] for a, b in zip(got, got[1:]))
    scores = dict((item["index"], item["score"]) for item in got)
    assert np.abs(np.array([scores[i] for i in range(1000)]) - want).max() <= MAX_SCORE_DIFFERENCE


def test_the_classifier_answers_every_label(server, models):
    texts = ["hello world", "the cat sat on the mat", "a dog"]  # two texts would be one pair
    # CrossEncoder.predict takes one text alone, not a list of texts.
    want = [reference_scores(models["classifier"], text, activation_fn=__import__("torch").nn.Identity(),
                             apply_softmax=True) for text in texts]
    batch = post(server, "classifier", "predict", {"inputs": texts})
    for row, expected in zip(batch, want):
        assert {item["label"] for item in row} == set(LABELS)
        assert [item["score"] for item in row] == sorted((item["score"] for item in row), reverse=True)
        got = dict((item["label"], item["score"]) for item in row)
        assert np.abs(np.array([got[label] for label in LABELS]) - expected).max() <= MAX_SCORE_DIFFERENCE
    single = post(server, "classifier", "predict", {"inputs": "hello world"})
    assert single == batch[0]
    pair = post(server, "classifier", "predict", {"inputs": ["hello", "world"]})
    assert isinstance(pair[0], dict)  # a pair is one input: one list of labels


def test_info_says_the_task_labels_and_routes(server):
    info = requests.get(f"{server.url('inference')}/predictions/bert/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["task"] == "rerank" and info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}}}
    assert set(info["routes"]) == {"rerank", "predict", "v1/rerank", "v2/rerank"}
    info = requests.get(f"{server.url('inference')}/predictions/classifier/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["task"] == "classify" and info["routes"] == ["predict"]
    assert info["model_type"]["classifier"]["id2label"] == {str(i): label for i, label in enumerate(LABELS)}


def test_the_official_cohere_client(server, models):
    cohere = pytest.importorskip("cohere")
    client = cohere.ClientV2(api_key=server.auth()["Authorization"].split()[-1],
                             base_url=f"{server.url('inference')}/predictions/bert/1.0")
    documents = [document for _, document in PAIRS]
    answer = client.rerank(model="bert", query=PAIRS[0][0], documents=documents, top_n=2)
    want = reference_scores(models["bert"], [(PAIRS[0][0], document) for document in documents])
    assert [item.index for item in answer.results] == list(np.argsort(-want, kind="stable"))[:2]
    assert abs(answer.results[0].relevance_score - want.max()) <= MAX_SCORE_DIFFERENCE


BAD = [
    ("rerank", {"query": "q", "texts": []}, 400, "texts"),
    ("rerank", {"query": "", "texts": ["a"]}, 400, "query"),
    ("rerank", {"query": "q", "texts": ["a", 3]}, 400, "texts[1]"),
    ("rerank", {"texts": ["a"]}, 400, "query"),
    ("rerank", {"query": "q", "texts": ["a " * 200], "truncate": False}, 413, "texts[0]"),
    ("v2/rerank", {"query": "q", "documents": [{"txt": "a"}]}, 400, "documents[0].text"),
    ("v2/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
    ("v2/rerank", {"query": "q", "documents": ["a"], "instruction": "rank"}, 400, "instruction"),
    ("v1/rerank", {"query": "q", "documents": ["a"] * 1501}, 413, "documents"),
    ("predict", {"inputs": [["a", "b", "c"]]}, 400, "inputs[0]"),
    ("v1/embeddings", {"input": "a"}, 404, None),
]


def test_bad_requests_fail_alone_and_no_worker_restarts(server):
    before = workers(server, "bert")
    good = {"query": "hello", "texts": ["world", "the cat"]}
    with ThreadPoolExecutor(16) as pool:  # bad and good requests share TorchServe's batches
        futures = [(case, pool.submit(requests.post, f"{server.url('inference')}/predictions/bert/1.0/{case[0]}",
                                      json=case[1], headers=server.auth(), timeout=120)) for case in BAD]
        goods = [pool.submit(requests.post, f"{server.url('inference')}/predictions/bert/1.0/rerank", json=good,
                             headers=server.auth(), timeout=120) for _ in range(16)]
    for (route, body, status, field), future in futures:
        response = future.result()
        assert response.status_code == status, (route, body, response.text)
        assert field is None or field in str(response.json()), (route, body, response.text)
    assert all(future.result().status_code == 200 for future in goods)
    assert workers(server, "bert") == before


def test_each_task_refuses_the_other_s_routes(server):
    answer = post(server, "bert", "embed", {"inputs": "a"}, status=404)
    assert "rerank" in str(answer)
    answer = post(server, "classifier", "rerank", {"query": "q", "texts": ["a"]}, status=404)
    assert "predict" in str(answer)


def test_metrics_count_pairs_under_their_task(server):
    before = settled_metric_samples(server, "xlmr")
    post(server, "xlmr", "rerank", {"query": "hello", "texts": ["world", "the cat", "a dog"]})
    post(server, "xlmr", "predict", {"inputs": ["hello", "world"]})
    after = metric_samples_after(server, before, requests=2, model="xlmr")
    assert metric_growth(before, after, "EmbedInputs", 'Task="rerank"') == 4
    assert metric_growth(before, after, "EmbedRequests") == 2
