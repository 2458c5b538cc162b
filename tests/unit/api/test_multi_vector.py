"""Multi-vector (ColBERT) models in process, against sentence-transformers' MultiVectorEncoder:
token vectors of queries (expansion fixed or min, attended or not), documents (skiplist) and
inputs of neither type, MaxSim rankings, the routes' bodies, options and bad inputs."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.model.description import ModelFilesError, Task
from embedserve.handler.model.files import describe_model
from embedserve.handler.settings import Settings
from tests.support.multi_vector_models import make_colbert, reference_maxsim, reference_tokens

SHAPES = {"fixed": {}, "min-attend": dict(expansion="min", attend=True), "plain": dict(expansion=False, skiplist=False),
          "xlmr": dict(family="xlmr")}
QUERIES = ["a", "hello world", "the cat sat on the mat, fast!", "what is the relevant passage for this question " * 3]
DOCUMENTS = ["a", "hello, world!", "The cat sat on the mat. café naïve", "!?", "one two three four five six " * 8,
             "東京 日本 42 3.14 (über)"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("colbert")
    return {name: make_colbert(root / name, **shape) for name, shape in SHAPES.items()}


@pytest.fixture(scope="module")
def services(models):
    return {name: assemble(path, Settings(dtype="float32"), model_name="cb", warm=True)
            for name, path in models.items()}


def call(svc, route, body, content_type="application/json"):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    [response] = svc.handle([RawRequest(raw, content_type, route)])
    return response.status, json.loads(response.body)


def min_cosine(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    least = 1.0
    for row, expected in zip(got, want, strict=True):
        assert row.shape == expected.shape
        least = min(least, float(((row * expected).sum(1) / np.linalg.norm(row, axis=1)
                                  / np.linalg.norm(expected, axis=1)).min()))
    return least


def test_the_folder_says_multi_vector_with_its_knobs(models):
    description = describe_model(models["fixed"]).served_with("auto")
    assert description.task is Task.MULTI_VECTOR and description.dimension == 16
    knobs = description.multi_vector
    assert (knobs.query_length, knobs.document_length, knobs.expansion.strategy, knobs.expansion.attend) == \
        (12, 24, "fixed", False)
    assert description.prompts == {"query": "[Q] ", "document": "[D] "}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("kind", ["query", "document", None])
def test_token_vectors_are_multi_vector_encoder_s(models, services, name, kind):
    texts = QUERIES if kind == "query" else DOCUMENTS
    status, answer = call(services[name], "", {"input": texts, **({"input_type": kind} if kind else {})})
    assert status == 200
    got = [np.asarray(item["embedding"]) for item in answer["data"]]
    assert min_cosine(got, reference_tokens(models[name], texts, kind=kind)) >= 0.9999


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_rerank_scores_are_maxsim(models, services, name):
    query = QUERIES[2]
    status, ranked = call(services[name], "rerank", {"query": query, "texts": DOCUMENTS, "return_text": True})
    assert status == 200
    want = reference_maxsim(models[name], query, DOCUMENTS)
    assert [item["index"] for item in ranked] == sorted(range(len(DOCUMENTS)), key=lambda i: (-want[i], i))
    assert max(abs(item["score"] - want[item["index"]]) for item in ranked) <= 1e-4
    assert all(item["text"] == DOCUMENTS[item["index"]] for item in ranked)


@pytest.mark.parametrize("route", ["v1/rerank", "v2/rerank"])
def test_cohere_s_rerank_is_maxsim_too(models, services, route):
    query = QUERIES[1]
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]]  # Cohere's two document forms
    status, answer = call(services["fixed"], route, {"model": "cb", "query": query, "documents": documents,
                                                     "top_n": 2, "return_documents": True, "raw_scores": True})
    assert status == 200, answer
    want = reference_maxsim(models["fixed"], query, DOCUMENTS)
    best = sorted(range(len(DOCUMENTS)), key=lambda i: (-want[i], i))[:2]
    assert [item["index"] for item in answer["results"]] == best
    assert max(abs(item["relevance_score"] - want[item["index"]]) for item in answer["results"]) <= 1e-4
    assert [item["document"]["text"] for item in answer["results"]] == [DOCUMENTS[i] for i in best]
    assert answer["meta"]["api_version"]["version"] == route[1] and answer["usage"]["total_tokens"] > 0


def test_embed_all_base64_and_dtypes(services):
    svc = services["fixed"]
    _, [floats] = call(svc, "embed_all", {"inputs": ["hello world"], "input_type": "document"})
    floats = np.asarray(floats, dtype=np.float32)
    status, answer = call(svc, "", {"input": "hello world", "input_type": "document", "encoding_format": "base64"})
    assert status == 200
    raw = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4").reshape(floats.shape)
    np.testing.assert_allclose(raw, floats, atol=1e-7)
    _, answer = call(svc, "", {"input": "hello world", "input_type": "document", "output_dtype": "int8"})
    codes = np.asarray(answer["data"][0]["embedding"])
    assert codes.shape == floats.shape and codes.min() >= -128 and codes.max() <= 127
    status, answer = call(svc, "", "hello world", content_type="text/plain")
    assert status == 200 and np.asarray(answer["data"][0]["embedding"]).shape[1] == 16


@pytest.mark.parametrize("route,body,status,param", [
    ("", {"input": "a", "input_type": "passage"}, 400, "input_type"),
    ("", {"input": "a", "prompt_name": "query"}, 400, "prompt_name"),
    ("", {"input": [[1, 2]]}, 400, "input[0]"),
    ("", {"input": "a", "output_dtype": "float16"}, 400, "output_dtype"),
    ("", {"input": "word " * 200, "input_type": "document", "truncate": False}, 413, "input[0]"),
    ("rerank", {"query": "a"}, 400, None),
    ("rerank", {"query": "a", "texts": []}, 400, None),
    ("embed_all", {"inputs": 5}, 400, None),
    ("v2/rerank", {"query": "a", "documents": ["b"], "instruction": "rank"}, 400, "instruction"),
    ("v2/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, 400, "top_n"),
    ("v1/rerank", {"query": "a", "documents": [{"txt": "b"}]}, 400, "documents[0].text"),
    ("v1/rerank", {"query": "a", "documents": ["b"], "model": 3}, 400, "model"),
])
def test_bad_requests_name_the_field(services, route, body, status, param):
    got, answer = call(services["fixed"], route, body)
    assert got == status, answer
    if route in ("rerank", "embed_all"):  # TEI's error shape
        assert answer["error_type"] and answer["error"]
    else:
        assert answer["error"]["param"] == param, answer


def test_openai_s_route_answers_the_native_list_and_other_routes_404(services):
    svc = services["fixed"]
    body = {"input": ["a cat"], "input_type": "query", "encoding_format": "float"}
    status, answer = call(svc, "v1/embeddings", {**body, "model": "colbert"})
    assert status == 200 and answer["data"] == call(svc, "", body)[1]["data"]
    status, answer = call(svc, "embed", {"inputs": "a"})
    assert status == 404 and "'embed_all'" in answer["error"] and "'v1/embeddings'" in answer["error"]


def test_info_and_openapi(services):
    svc = services["fixed"]
    info = svc.info()
    assert info["task"] == "multi_vector" and info["routes"] == ["", "v1/embeddings", "embed_all", "rerank", "v1/rerank",
                                                                 "v2/rerank"]
    from openapi_spec_validator import validate

    document = svc.openapi()
    validate(document)
    assert any(path.endswith("/1.0/embed_all") for path in document["paths"])


def test_a_declared_token_pooling_clusters_documents_as_the_reference(tmp_path):
    model = make_colbert(tmp_path / "pooled", pool_factor=2.0, document_length=48)
    svc = assemble(model, Settings(dtype="float32"), model_name="cb", warm=False)
    assert "HierarchicalTokenPooling(2)" in svc.info()["modules"]
    for kind in ("document", None, "query"):
        _, answer = call(svc, "", {"input": DOCUMENTS, **({"input_type": kind} if kind else {})})
        got = [np.asarray(item["embedding"]) for item in answer["data"]]
        assert min_cosine(got, reference_tokens(model, DOCUMENTS, kind=kind)) >= 0.9999


def test_other_layouts_are_refused(models, tmp_path):
    import shutil

    folder = shutil.copytree(models["plain"], tmp_path / "other")
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules[:3]))  # no Normalize
    with pytest.raises(ModelFilesError, match="a multi-vector encoder with modules"):
        describe_model(folder)
    (folder / "modules.json").write_text(json.dumps(modules))
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**config, "model_type": "ColBERT"}))
    with pytest.raises(ModelFilesError, match="PyLate"):
        describe_model(folder)
