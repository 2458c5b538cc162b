"""Rerankers and classifiers in process: what the model folder says (task, labels, activation),
pairs tokenized as the Hugging Face tokenizer does for CrossEncoder, the scoring routes' bodies
and answers, and their bad inputs, against sentence-transformers' CrossEncoder.predict."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from embedserve.handler.api.route import Route
from embedserve.handler.api.errors import RequestError
from embedserve.handler.assembly import assemble
from embedserve.handler.model.description import LogitScore, ModelFilesError
from embedserve.handler.model.files import describe_model
from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.settings import Settings
from tests.support.wire import parse_request
from tests.support.rerankers import LABELS, PAIRS, make_reranker, reference_scores


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory):
    root = tmp_path_factory.mktemp("scoring")
    return {family: make_reranker(family, root / family) for family in ("bert", "xlmr", "classifier", "qwen3")}


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


def test_a_causal_reranker_is_its_logit_score_over_the_last_token(rerankers):
    qwen = describe_model(rerankers["qwen3"])
    tokenizer = AutoTokenizer.from_pretrained(rerankers["qwen3"])
    assert (qwen.task, qwen.scoring.labels, qwen.scoring.activation, qwen.pooling.modes) == \
        ("rerank", ("LABEL_0",), "Sigmoid", ("last_token",))
    assert qwen.scoring.logit_score == LogitScore(tokenizer.convert_tokens_to_ids("yes"),
                                                  tokenizer.convert_tokens_to_ids("no"))
    assert qwen.scoring.chat.message_format == "flat" and qwen.scoring.chat.restore_suffix
    assert not qwen.scoring.own_head and qwen.dimension == 1


@pytest.mark.parametrize("change, message", [
    (lambda d: _edit(d / "modules.json", lambda m: m[:1] + [{**m[1], "type": "sentence_transformers.Dense"}]),
     "Transformer then LogitScore"),
    (lambda d: _edit(d / "sentence_bert_config.json", lambda c: {**c, "modality_config": {"text": {}}}),
     "not rendered by a chat template"),
    (lambda d: _edit(d / "sentence_bert_config.json",
                     lambda c: {**c, "processing_kwargs": {"text": {"max_length": 8}}}),
     "processing_kwargs"),
    (lambda d: _edit(d / "1_LogitScore" / "config.json", lambda c: {**c, "true_token_id": 10**6}),
     "true_token_id"),
    (lambda d: _edit(d / "config.json", lambda c: {**c, "architectures": ["Qwen3ForSequenceClassification"]}),
     "LogitScore reads a causal language model"),
])
def test_a_causal_reranker_it_cannot_serve_exactly_is_refused_naming_why(rerankers, tmp_path, change, message):
    import shutil

    model_dir = shutil.copytree(rerankers["qwen3"], tmp_path / "qwen3")
    change(model_dir)
    with pytest.raises(ModelFilesError, match=message):
        describe_model(model_dir)


def _edit(path, change):
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.mark.parametrize("instruction", [None, "Find what a cat is"])
def test_causal_pairs_are_the_ids_cross_encoder_renders(rerankers, instruction):
    """Rendered by the chat template, cut at the limit, the template's tail written back over a
    cut row: the ids sentence-transformers' CrossEncoder feeds its model."""
    from sentence_transformers import CrossEncoder

    svc = service(rerankers["qwen3"])
    max_length = svc.text.max_length
    features = CrossEncoder(str(rerankers["qwen3"])).preprocess(PAIRS, prompt=instruction)
    want = [[token for token, real in zip(row, mask) if real]
            for row, mask in zip(features["input_ids"].tolist(), features["attention_mask"].tolist())]
    got = svc.work.chat_pairs.pairs(PAIRS, max_length, "right", instruction or "")
    assert [item.ids for item in got] == want
    cut = [item for item in got if item.full_length > max_length]
    assert cut and all(len(item.ids) == max_length for item in cut)
    tail = svc.work.chat_pairs.hf.encode("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>",
                                             add_special_tokens=False)
    assert all(item.ids[-len(tail) - 1:-1] == tail or item.ids[-len(tail):] == tail for item in got)


def test_a_structured_template_gets_structured_messages(rerankers, tmp_path):
    """A template that reads content[0].text: sentence-transformers' "structured" message format."""
    import shutil

    from sentence_transformers import CrossEncoder

    model_dir = shutil.copytree(rerankers["qwen3"], tmp_path / "qwen3")
    template = (model_dir / "chat_template.jinja").read_text()
    for role in ("system", "query", "document"):  # each message's text from its first content part
        template = template.replace(f'{{%- set {role} = messages | selectattr("role", "eq", "{role}") | '
                                    'map(attribute="content") | first -%}',
                                    f'{{%- set m = messages | selectattr("role", "eq", "{role}") | first -%}}'
                                    f'{{%- set {role} = m.content[0].text if m else "" -%}}')
    assert template.count("content[0].text") == 3
    (model_dir / "chat_template.jinja").write_text(template)
    _edit(model_dir / "sentence_bert_config.json", lambda c: {**c, "modality_config": {
        **c["modality_config"], "message": {**c["modality_config"]["message"], "format": "structured"}}})
    assert describe_model(model_dir).scoring.chat.message_format == "structured"
    features = CrossEncoder(str(model_dir)).preprocess(PAIRS[:3], prompt="Find it")
    want = [[token for token, real in zip(row, mask) if real]
            for row, mask in zip(features["input_ids"].tolist(), features["attention_mask"].tolist())]
    svc = service(model_dir)
    got = svc.work.chat_pairs.pairs(PAIRS[:3], svc.text.max_length, "right", "Find it")
    assert [item.ids for item in got] == want
    assert "Find it" in svc.work.chat_pairs.hf.decode(got[0].ids)


def test_the_model_s_default_prompt_is_the_default_instruction(rerankers, tmp_path):
    import shutil

    model_dir = shutil.copytree(rerankers["qwen3"], tmp_path / "qwen3")
    _edit(model_dir / "config_sentence_transformers.json",
          lambda c: {**c, "prompts": {"web": "Find web pages about it"}, "default_prompt_name": "web"})
    query, documents = PAIRS[1][0], [document for _, document in PAIRS]
    want = reference_scores(model_dir, [(query, d) for d in documents])  # CrossEncoder applies its default prompt
    status, answer = call(service(model_dir), "v2/rerank", {"query": query, "documents": documents})
    got = {item["index"]: item["relevance_score"] for item in answer["results"]}
    assert status == 200 and np.abs(np.array([got[i] for i in range(len(documents))]) - want).max() <= 1e-5
    assert not np.allclose(want, reference_scores(model_dir, [(query, d) for d in documents], prompt=""))


def test_a_pair_the_template_refuses_is_that_request_s_422(rerankers, tmp_path):
    import shutil

    model_dir = shutil.copytree(rerankers["qwen3"], tmp_path / "qwen3")
    template = (model_dir / "chat_template.jinja").read_text()
    (model_dir / "chat_template.jinja").write_text(
        "{%- if 'FORBIDDEN' in messages | map(attribute='content') | join(' ') -%}"
        "{{ raise_exception('no FORBIDDEN here') }}{%- endif -%}" + template)
    svc = service(model_dir)
    bodies = [{"query": "q", "texts": ["a", "FORBIDDEN"]}, {"query": "q", "texts": ["a", "b"]}]
    responses = svc.handle([RawRequest(json.dumps(body).encode(), "application/json", "rerank") for body in bodies])
    assert [response.status for response in responses] == [422, 200]
    assert "no FORBIDDEN here" in json.loads(responses[0].body)["error"]


def test_left_truncation_of_a_causal_pair_keeps_its_end(rerankers):
    svc = service(rerankers["qwen3"])
    [right, left] = [svc.work.chat_pairs.pairs([PAIRS[3]], 100, side)[0] for side in ("right", "left")]
    full = svc.work.chat_pairs.pairs([PAIRS[3]], 10**6, "right")[0]
    tail = len(svc.work.chat_pairs.suffix(""))
    assert 0 < tail < 50 and full.full_length > 100 and left.ids == full.ids[-100:]
    assert right.ids == full.ids[:100 - tail] + full.ids[-tail:]


def test_instructions_and_pairs_only_for_a_causal_reranker(rerankers):
    qwen, bert = service(rerankers["qwen3"], cache_entries=64), service(rerankers["bert"])
    query, documents = PAIRS[0][0], [document for _, document in PAIRS]
    want = reference_scores(rerankers["qwen3"], [(query, d) for d in documents], prompt="Find greetings")
    status, answer = call(qwen, "v1/rerank", {"query": query, "documents": documents, "instruction": "Find greetings"})
    got = {item["index"]: item["relevance_score"] for item in answer["results"]}
    assert status == 200 and np.abs(np.array([got[i] for i in range(len(documents))]) - want).max() <= 1e-5
    status, plain = call(qwen, "v1/rerank", {"query": query, "documents": documents})
    assert status == 200 and plain["results"] != answer["results"]  # the template's default instruction
    assert len(qwen.cache.memory) == 2 * len(documents)  # an instruction is part of each pair's ids
    status, answer = call(qwen, "predict", {"inputs": [["a", "b"], "one text"]})
    assert status == 422 and "'inputs[1]' is a single text" in answer["error"]
    status, answer = call(qwen, "v2/rerank", {"query": "q", "documents": ["a"], "instruction": "x" * 100_001})
    assert status == 413 and answer["error"]["param"] == "instruction"
    status, answer = call(bert, "v2/rerank", {"query": "q", "documents": ["a"], "instruction": "rank"})
    assert status == 400 and answer["error"]["param"] == "instruction"  # invalid_value, in the Cohere shape


@pytest.mark.parametrize("direction", ["right", "left"])
def test_pairs_are_tokenized_as_the_hugging_face_tokenizer_does(rerankers, direction):
    svc = service(rerankers["bert"])
    reference = AutoTokenizer.from_pretrained(rerankers["bert"], truncation_side=direction)
    got = svc.text.tokenizer.pairs(PAIRS, 24, direction)
    want = reference([a for a, _ in PAIRS], [b for _, b in PAIRS], truncation="longest_first", max_length=24)
    for item, ids, types in zip(got, want["input_ids"], want["token_type_ids"]):
        assert item.ids == ids and item.second == types.index(1)
    assert max(item.full_length for item in got) > 24


def test_a_tokenizer_without_token_types_gives_none(rerankers):
    """XLM-R's tokenizer hands the model no token types: no second segment is marked."""
    svc = service(rerankers["xlmr"])
    assert all(item.second == 0 for item in svc.text.tokenizer.pairs(PAIRS, 64, "right"))


@pytest.mark.parametrize("family", ["bert", "xlmr", "qwen3"])
@pytest.mark.parametrize("engine", ["torch", "onnxruntime"])
def test_scores_equal_cross_encoder_predict(rerankers, family, engine, tmp_path):
    model_dir = rerankers[family]
    if engine == "onnxruntime":  # the build's export, in a copy of the folder
        import shutil

        from embedserve.archive.onnx_export import export_onnx

        model_dir = shutil.copytree(model_dir, tmp_path / family)
        description = describe_model(model_dir)
        assert export_onnx(model_dir, description.usable_positions, scoring=description.scoring.own_head,
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
        parse_request(json.dumps(body).encode(), "application/json", route.value)
    assert caught.value.status == 400 and field in str(caught.value.body())


def test_predict_forms_are_tei_s(rerankers):
    svc = service(rerankers["classifier"])
    status, single = call(svc, "predict", {"inputs": "hello"})
    assert status == 200 and {item["label"] for item in single} == set(LABELS)
    assert abs(sum(item["score"] for item in single) - 1) < 1e-5  # a classifier's softmax, as TEI answers
    status, batch = call(svc, "predict", {"inputs": ["hello", ["a", "b"], "c"]})
    assert status == 200 and len(batch) == 3
    # The same text alone and in a batch: the same labels, scores equal up to float rounding (a
    # padded pass of three rows may take other kernels than a pass of one).
    assert [item["label"] for item in batch[0]] == [item["label"] for item in single]
    assert all(abs(a["score"] - b["score"]) < 1e-6 for a, b in zip(batch[0], single))


def test_each_task_refuses_the_other_s_routes(rerankers, tiny_model_dir):
    status, answer = call(service(rerankers["classifier"]), "rerank", {"query": "q", "texts": ["a"]})
    assert status == 404 and "'predict'" in answer["error"]
    status, answer = call(service(tiny_model_dir), "v1/rerank", {"query": "q", "documents": ["a"]})
    assert status == 404 and "v1/embeddings" in answer["error"]["message"]


def test_the_cache_keys_scores_by_the_pair_s_token_types(rerankers):
    svc = service(rerankers["bert"], cache_entries=64)
    cache = svc.cache
    plain, pair_at_2, pair_at_1 = ModelInput([1, 2, 3]), ModelInput([1, 2, 3], 0, 2), ModelInput([1, 2, 3], 0, 1)
    assert cache.key(plain) != cache.key(pair_at_2) != cache.key(pair_at_1)
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


@pytest.mark.parametrize("route", ["v1/rerank", "v2/rerank"])
def test_the_cohere_rerank_document_holds_the_fields_the_route_checks(rerankers, route):
    """`model` and `user` are checked to be strings, then ignored: the request schema says so, so
    that a body it allows (schemathesis sent `"user": []`) is not refused."""
    import jsonschema

    svc = service(rerankers["bert"])
    document = svc.openapi()
    schema = {**document["components"]["schemas"]["CohereRerankRequest"], "components": document["components"]}
    validator = jsonschema.Draft202012Validator(schema)
    good = {"query": "a cat", "documents": ["a small animal", "a car"], "model": "m", "user": "u"}
    assert validator.is_valid(good) and call(svc, route, good)[0] == 200
    for field in ("model", "user"):
        bad = {**good, field: []}
        assert not validator.is_valid(bad)
        status, answer = call(svc, route, bad)
        assert status == 400 and answer["error"]["param"] == field
