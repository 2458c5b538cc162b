"""Rerankers and classifiers in process: what the model folder says (task, labels, activation),
pairs tokenized as the Hugging Face tokenizer does for CrossEncoder, the scoring routes' bodies
and answers, and their bad inputs, against sentence-transformers' CrossEncoder.predict."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from embedserve.handler.api.codec import Route
from embedserve.handler.api.errors import RequestError
from embedserve.handler.api.scoring import parse_scoring
from embedserve.handler.assembly import assemble
from embedserve.handler.model.files import ModelFilesError, describe_model
from embedserve.handler.service import RawRequest
from embedserve.handler.settings import Settings
from tests.support.rerankers import LABELS, PAIRS, make_reranker, reference_scores


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory):
    root = tmp_path_factory.mktemp("scoring")
    return {family: make_reranker(family, root / family) for family in ("bert", "xlmr", "classifier")}


def service(model_dir, **settings):
    return assemble(model_dir, Settings(**{"dtype": "float32", **settings}), model_name="r", warm=True)


def call(svc, route, body):
    [response] = svc.handle([RawRequest(json.dumps(body).encode(), "application/json", route)])
    return response.status, json.loads(response.body)


def test_the_folder_says_task_labels_activation_and_token_types(rerankers):
    bert, xlmr, classifier = (describe_model(rerankers[f]) for f in ("bert", "xlmr", "classifier"))
    assert (bert.task, bert.scoring.labels, bert.scoring.activation, bert.scoring.segments) == \
        ("rerank", ("LABEL_0",), "Sigmoid", True)
    assert xlmr.task == "rerank"
    assert (classifier.task, classifier.scoring.labels, classifier.scoring.activation) == \
        ("classify", LABELS, "Identity")
    assert bert.dimension == 1 and classifier.dimension == 3


def test_a_causal_lm_reranker_is_refused_naming_why(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8,
                                                      "architectures": ["Qwen3ForCausalLM"]}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_LogitScore",
         "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}]))
    with pytest.raises(ModelFilesError, match="chat template"):
        describe_model(tmp_path)


@pytest.mark.parametrize("direction", ["right", "left"])
def test_pairs_are_tokenized_as_the_hugging_face_tokenizer_does(rerankers, direction):
    svc = service(rerankers["bert"])
    reference = AutoTokenizer.from_pretrained(rerankers["bert"], truncation_side=direction)
    got = svc.preparer.tokenizer.pairs(PAIRS, 24, direction)
    want = reference([a for a, _ in PAIRS], [b for _, b in PAIRS], truncation="longest_first", max_length=24)
    for item, ids, types in zip(got, want["input_ids"], want["token_type_ids"]):
        assert item.ids == ids and item.second == types.index(1)
    assert max(item.full_length for item in got) > 24


def test_a_tokenizer_without_token_types_gives_none(rerankers):
    """XLM-R's tokenizer hands the model no token types: no second segment is marked."""
    svc = service(rerankers["xlmr"])
    assert all(item.second == 0 for item in svc.preparer.tokenizer.pairs(PAIRS, 64, "right"))


@pytest.mark.parametrize("family", ["bert", "xlmr"])
@pytest.mark.parametrize("engine", ["torch", "onnxruntime"])
def test_scores_equal_cross_encoder_predict(rerankers, family, engine, tmp_path):
    model_dir = rerankers[family]
    if engine == "onnxruntime":  # the build's export, in a copy of the folder
        import shutil

        from embedserve.archive.onnx_export import export_onnx

        model_dir = shutil.copytree(model_dir, tmp_path / family)
        description = describe_model(model_dir)
        assert export_onnx(model_dir, description.usable_positions, scoring=True,
                           segments=description.scoring.segments).startswith("exported")
    svc = service(model_dir, engine=engine)
    assert svc.info()["engine"] == engine
    status, answer = call(svc, "predict", {"inputs": [list(pair) for pair in PAIRS]})
    assert status == 200
    assert np.abs(np.array([row[0]["score"] for row in answer]) - reference_scores(model_dir)).max() <= 1e-5
    status, raw = call(svc, "predict", {"inputs": [list(pair) for pair in PAIRS], "raw_scores": True})
    logits = reference_scores(model_dir, activation_fn=torch.nn.Identity())
    assert np.abs(np.array([row[0]["score"] for row in raw]) - logits).max() <= 1e-5


def test_rerank_answers_best_first_in_every_shape(rerankers):
    svc = service(rerankers["bert"])
    query, documents = "hello world", ["the cat sat", "a dog", "hello world", "x"]
    want = reference_scores(rerankers["bert"], [(query, d) for d in documents])
    order = list(np.argsort(-want, kind="stable"))
    status, tei = call(svc, "rerank", {"query": query, "texts": documents})
    assert status == 200 and [item["index"] for item in tei] == order and "text" not in tei[0]
    status, cohere = call(svc, "v2/rerank", {"query": query, "documents": documents, "top_n": 2,
                                             "return_documents": True})
    assert [item["index"] for item in cohere["results"]] == order[:2]
    assert cohere["results"][0]["document"]["text"] == documents[order[0]]
    status, jina = call(svc, "v1/rerank", {"model": "r", "query": query, "documents": [{"text": d} for d in documents]})
    assert [item["index"] for item in jina["results"]] == order and jina["usage"]["total_tokens"] > 0


def test_truncation_off_refuses_a_long_pair_alone(rerankers):
    svc = service(rerankers["bert"])
    long = "batch request token " * 60
    bodies = [{"query": "q", "texts": ["a", long], "truncate": False}, {"query": "q", "texts": ["a", long]}]
    responses = svc.handle([RawRequest(json.dumps(body).encode(), "application/json", "rerank") for body in bodies])
    assert [r.status for r in responses] == [413, 200]
    assert "texts[1]" in json.loads(responses[0].body)["error"]
    status, answer = call(svc, "predict", {"inputs": [["q", "a"], ["q", long]], "truncate": False})
    assert status == 413 and answer["error"].startswith("'inputs[1]' has")
    status, answer = call(service(rerankers["bert"], max_input_chars=50), "predict", {"inputs": [["q", "a" * 60]]})
    assert status == 413 and "'inputs[0][1]'" in answer["error"]


@pytest.mark.parametrize("route, body, field", [
    (Route.TEI_RERANK, {"query": "q", "texts": "a"}, "texts"),
    (Route.TEI_RERANK, {"query": ["q"], "texts": ["a"]}, "query"),
    (Route.RERANK_V2, {"query": "q", "documents": [{"text": 1}]}, "documents[0].text"),
    (Route.RERANK_V2, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    (Route.RERANK_V1, {"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    (Route.TEI_PREDICT, {"inputs": []}, "inputs"),
    (Route.TEI_PREDICT, {"inputs": [["a", ""]]}, "inputs[0][1]"),
    (Route.TEI_PREDICT, {"inputs": [{"a": 1}]}, "inputs[0]"),
])
def test_bad_bodies_name_the_field(route, body, field):
    with pytest.raises(RequestError) as caught:
        parse_scoring(json.dumps(body).encode(), "application/json", route)
    assert caught.value.status == 400 and field in str(caught.value.body())


def test_predict_forms_are_tei_s(rerankers):
    svc = service(rerankers["classifier"])
    status, single = call(svc, "predict", {"inputs": "hello"})
    assert status == 200 and {item["label"] for item in single} == set(LABELS)
    assert abs(sum(item["score"] for item in single) - 1) < 1e-5  # a classifier's softmax, as TEI answers
    status, batch = call(svc, "predict", {"inputs": ["hello", ["a", "b"], "c"]})
    assert status == 200 and len(batch) == 3 and batch[0] == single


def test_each_task_refuses_the_other_s_routes(rerankers, tiny_model_dir):
    status, answer = call(service(rerankers["classifier"]), "rerank", {"query": "q", "texts": ["a"]})
    assert status == 404 and "'predict'" in answer["error"]
    status, answer = call(service(tiny_model_dir), "v1/rerank", {"query": "q", "documents": ["a"]})
    assert status == 404 and "v1/embeddings" in answer["error"]["message"]


def test_the_cache_keys_scores_by_the_pair_s_token_types(rerankers):
    svc = service(rerankers["bert"], cache_entries=64)
    cache = svc.cache
    assert cache.key([1, 2, 3]) != cache.key([1, 2, 3], 0, 2) != cache.key([1, 2, 3], 0, 1)
    body = {"query": "hello", "texts": ["world", "cat"]}
    first, second = call(svc, "rerank", body), call(svc, "rerank", body)
    assert first == second and len(cache.memory) == 2


def test_similarity_is_the_cosine_of_sentence_transformers_embeddings(tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    svc = service(tiny_model_dir)
    source, sentences = "the cat sat", ["a cat sat on the mat", "dogs", "the cat sat"]
    status, answer = call(svc, "similarity", {"inputs": {"source_sentence": source, "sentences": sentences}})
    vectors = SentenceTransformer(str(tiny_model_dir), device="cpu").encode([source, *sentences],
                                                                            normalize_embeddings=True)
    assert status == 200 and np.abs(np.array(answer) - vectors[1:] @ vectors[0]).max() < 1e-5
    status, answer = call(svc, "similarity", {"inputs": {"source_sentence": source, "sentences": ["a " * 400]},
                                              "truncate": False})
    assert status == 413 and "'inputs.sentences[0]'" in answer["error"]
    for body, field in (({"inputs": {"sentences": ["a"]}}, "inputs.source_sentence"),
                        ({"inputs": {"source_sentence": "a", "sentences": ["b", 3]}}, "inputs.sentences[1]"),
                        ({"inputs": {"source_sentence": "a", "sentences": ["b"]}, "output_dtype": "int8"},
                         "output_dtype"),
                        ({"inputs": ["a", "b"]}, "inputs")):
        status, answer = call(svc, "similarity", body)
        assert status == 400 and f"'{field}'" in answer["error"], (body, answer)
