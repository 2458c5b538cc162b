"""Hybrid (bge-m3) models in process: a tiny bge-m3 folder staged as the build stages it (its .pt
heads converted to safetensors), its dense, sparse and ColBERT outputs against FlagEmbedding's
BGEM3 on the raw folder, the `outputs` option and which options apply to which output, base64
ColBERT matrices, TEI's routes, one forward pass for all three, the answer's size bound, bad
`outputs`, and what /info and the OpenAPI document say."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from openapi_spec_validator import validate

from embedserve.archive.smoke import m3_embedder_class
from embedserve.archive.stage import stage_model
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.model.description import ModelFilesError, Task
from embedserve.handler.model.files import describe_model
from embedserve.handler.settings import Settings
from tests.support.m3_models import MAX_LENGTH, make_m3, reference_m3
from tests.support.model_families import corpus
from tests.support.sparse_models import assert_same_sparse, served_sparse

ALL = ["dense", "sparse", "colbert"]
# ~50 texts: the corpus's, one token's worth ("a") and one over the max length (cut alike).
TEXTS = corpus(48, seed=7) + ["a", "hello world " * 60]
MIN_DENSE_COSINE = 0.99999
MIN_COLBERT_COSINE = 0.9999


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """The folder as a user has it: safetensors encoder, pickled heads."""
    return make_m3(tmp_path_factory.mktemp("m3") / "raw")


@pytest.fixture(scope="module")
def staged(raw):
    """The folder as the archive holds it: the heads converted to safetensors, no pickles."""
    stage_model(raw, raw.parent / "staged")
    return raw.parent / "staged"


@pytest.fixture(scope="module")
def svc(staged):
    return assemble(staged, Settings(dtype="float32"), model_name="m3", warm=True)


@pytest.fixture(scope="module")
def reference(raw):
    return reference_m3(raw, TEXTS)


def call(svc, route, body, content_type="application/json"):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    [response] = svc.handle([RawRequest(raw, content_type, route)])
    return response.status, json.loads(response.body)


def cosines(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)


def item_sparse(item):
    return dict(zip(item["sparse_embedding"]["indices"], item["sparse_embedding"]["values"]))


def assert_same_colbert(got, want):
    for i, (rows, expected) in enumerate(zip(got, want, strict=True)):
        rows = np.asarray(rows, dtype=np.float64)
        assert rows.shape == expected.shape, f"text {i}: {rows.shape} ColBERT vectors, FlagEmbedding {expected.shape}"
        assert cosines(rows, expected).min() >= MIN_COLBERT_COSINE, i


def test_staging_converts_the_heads_and_the_folder_says_hybrid(raw, staged):
    assert not list(staged.glob("*.pt"))
    description = describe_model(staged)
    assert description.task is Task.HYBRID and description.m3.colbert_dimension == 32
    assert description.modules[-2:] == ["SparseLinear(relu, max by token id)", "ColBERTLinear(32, normalized)"]


def test_a_folder_with_only_pickled_heads_is_refused_naming_the_build(raw):
    with pytest.raises(ModelFilesError, match="build_mar"):
        describe_model(raw)


@pytest.mark.parametrize("route", ["", "v1/embeddings"])
def test_all_three_outputs_are_flag_embedding_s(svc, reference, route):
    status, answer = call(svc, route, {"input": TEXTS, "outputs": ALL})
    assert status == 200, answer
    data = answer["data"]
    assert [item["index"] for item in data] == list(range(len(TEXTS)))
    assert cosines([item["embedding"] for item in data], reference["dense"]).min() >= MIN_DENSE_COSINE
    assert_same_sparse([item_sparse(item) for item in data], reference["sparse"])
    assert_same_colbert([item["colbert_embedding"] for item in data], reference["colbert"])
    # the longest text is cut at the max length: its first token left out, MAX_LENGTH - 1 vectors
    assert len(data[-1]["colbert_embedding"]) == MAX_LENGTH - 1
    assert answer["usage"]["prompt_tokens"] == sum(len(rows) + 1 for rows in reference["colbert"])


def test_the_default_answer_is_openai_s_dense_list(svc, reference):
    _, full = call(svc, "", {"input": TEXTS, "outputs": ALL})
    for route in ("", "v1/embeddings"):
        status, answer = call(svc, route, {"input": TEXTS})
        assert status == 200 and set(answer) == {"object", "data", "model", "usage"}
        assert answer["object"] == "list" and answer["model"] == "m3"
        assert all(set(item) == {"object", "index", "embedding"} and item["object"] == "embedding"
                   for item in answer["data"])
        # the same vectors the all-outputs request answers, and FlagEmbedding's
        assert [item["embedding"] for item in answer["data"]] == [item["embedding"] for item in full["data"]]
        assert cosines([item["embedding"] for item in answer["data"]], reference["dense"]).min() >= MIN_DENSE_COSINE
    assert call(svc, "", {"input": "a", "outputs": None})[1]["data"][0].keys() == {"object", "index", "embedding"}


@pytest.mark.parametrize("outputs,keys", [
    (["sparse"], {"sparse_embedding"}),
    (["colbert"], {"colbert_embedding"}),
    (["colbert", "dense"], {"embedding", "colbert_embedding"}),
    (["sparse", "colbert"], {"sparse_embedding", "colbert_embedding"}),
    ("sparse", {"sparse_embedding"}),  # a lone name is a list of one
])
def test_outputs_subsets_hold_only_what_was_asked(svc, reference, outputs, keys):
    status, answer = call(svc, "", {"input": TEXTS[:6], "outputs": outputs})
    assert status == 200, answer
    for i, item in enumerate(answer["data"]):
        assert set(item) == {"object", "index"} | keys
        if "sparse_embedding" in keys:
            assert_same_sparse([item_sparse(item)], [reference["sparse"][i]])
        if "colbert_embedding" in keys:
            assert_same_colbert([item["colbert_embedding"]], [reference["colbert"][i]])


@pytest.mark.parametrize("route", ["", "v1/embeddings"])
def test_base64_colbert_is_the_row_major_float32_matrix(svc, route):
    texts = TEXTS[:5]
    _, floats = call(svc, route, {"input": texts, "outputs": ["dense", "colbert"]})
    status, coded = call(svc, route, {"input": texts, "outputs": ["dense", "colbert"], "encoding_format": "base64"})
    assert status == 200
    for plain, item in zip(floats["data"], coded["data"]):
        matrix = np.asarray(plain["colbert_embedding"], dtype=np.float32)
        decoded = np.frombuffer(base64.b64decode(item["colbert_embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded.reshape(matrix.shape), matrix)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4"),
                                      np.asarray(plain["embedding"], dtype=np.float32))


def test_dimensions_cut_the_dense_vector_only(svc):
    status, answer = call(svc, "", {"input": TEXTS[:3], "outputs": ALL, "dimensions": 8})
    assert status == 200
    _, full = call(svc, "", {"input": TEXTS[:3], "outputs": ALL})
    for item, whole in zip(answer["data"], full["data"]):
        assert len(item["embedding"]) == 8
        cut = np.asarray(whole["embedding"][:8])
        np.testing.assert_allclose(item["embedding"], cut / np.linalg.norm(cut), rtol=1e-5, atol=1e-6)
        assert item["colbert_embedding"] == whole["colbert_embedding"]
        assert item["sparse_embedding"] == whole["sparse_embedding"]


def test_sparse_options_apply_to_the_sparse_output(svc):
    text = "the cat sat on the mat with a dog in the search model server 東京 café"
    _, full = call(svc, "", {"input": text, "outputs": ALL})
    whole = full["data"][0]
    weights = item_sparse(whole)
    assert len(weights) > 4

    _, answer = call(svc, "", {"input": text, "outputs": ALL, "max_active_dims": 3})
    item = answer["data"][0]
    assert item["sparse_embedding"]["indices"] == sorted(sorted(weights, key=weights.get, reverse=True)[:3])
    assert item["embedding"] == whole["embedding"] and item["colbert_embedding"] == whole["colbert_embedding"]

    cut = sorted(weights.values())[len(weights) // 2]
    _, answer = call(svc, "", {"input": text, "outputs": ["sparse"], "threshold": cut})
    assert answer["data"][0]["sparse_embedding"]["indices"] == sorted(i for i, w in weights.items() if w >= cut)

    _, answer = call(svc, "v1/embeddings", {"input": text, "outputs": ["sparse", "dense"], "sparse_format": "tokens"})
    backend = svc.text.tokenizer.backend
    assert answer["data"][0]["sparse_embedding"] == {backend.id_to_token(i): w for i, w in weights.items()}
    assert answer["data"][0]["embedding"] == whole["embedding"]


@pytest.mark.parametrize("outputs", [[], [1], ["dense", "dense"], ["dense", "lexical"], "all", {"dense": True},
                                     [["dense"]], True])
@pytest.mark.parametrize("route", ["", "v1/embeddings"])
def test_bad_outputs_are_400_naming_outputs(svc, route, outputs):
    status, answer = call(svc, route, {"input": "a", "outputs": outputs})
    assert status == 400, answer
    assert answer["error"]["param"] == "outputs" and "outputs" in answer["error"]["message"]


def test_a_tei_body_on_the_native_route_is_dense_only(svc, reference):
    status, answer = call(svc, "", {"inputs": "a", "outputs": ["sparse"]})
    assert status == 400 and "outputs" in json.dumps(answer), answer
    status, answer = call(svc, "", {"inputs": ["a"], "outputs": ["dense", "colbert"]})
    assert status == 400, answer
    status, answer = call(svc, "", {"inputs": TEXTS[:4], "outputs": ["dense"]})
    assert status == 200 and cosines(answer, reference["dense"][:4]).min() >= MIN_DENSE_COSINE
    status, answer = call(svc, "", {"inputs": TEXTS[:4]})
    assert status == 200 and len(answer) == 4 and len(answer[0]) == 32


def test_tei_embed_is_dense_and_embed_sparse_is_sparse_in_tei_s_shape(svc, reference):
    status, answer = call(svc, "embed", {"inputs": TEXTS})
    assert status == 200 and cosines(answer, reference["dense"]).min() >= MIN_DENSE_COSINE
    status, answer = call(svc, "embed_sparse", {"inputs": TEXTS})
    assert status == 200 and all(set(entry) == {"index", "value"} for row in answer for entry in row)
    assert_same_sparse(served_sparse(answer), reference["sparse"])
    status, answer = call(svc, "embed_sparse", {"inputs": TEXTS[:2], "max_active_dims": 1})
    assert status == 200 and [len(row) for row in answer] == [1, 1]
    assert call(svc, "embed", {"inputs": "a", "outputs": ["sparse"]})[0] == 400  # /embed is dense only
    assert call(svc, "similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}})[0] == 404


def test_one_forward_pass_gives_all_three(svc):
    def passes(body):
        [response], report = svc.handle_with_report([RawRequest(json.dumps(body).encode(), "application/json", "")])
        assert response.status == 200
        return report.forward_passes

    dense = passes({"input": TEXTS})
    assert dense >= 1
    assert passes({"input": TEXTS, "outputs": ALL}) == dense
    assert passes({"input": TEXTS, "outputs": ["sparse", "colbert"]}) == dense


def test_requests_of_a_batch_each_get_their_own_outputs(svc):
    bodies = [("", {"input": TEXTS[:3], "outputs": ALL}), ("", {"input": TEXTS[3:5]}),
              ("", {"input": "x", "outputs": ["nope"]}), ("embed_sparse", {"inputs": TEXTS[5:7]}),
              ("v1/embeddings", {"input": TEXTS[7:9], "outputs": ["colbert"], "encoding_format": "base64"}),
              ("embed", {"inputs": TEXTS[9:10]})]
    responses = svc.handle([RawRequest(json.dumps(body).encode(), "application/json", route)
                            for route, body in bodies])
    assert [response.status for response in responses] == [200, 200, 400, 200, 200, 200]
    for (route, body), response in zip(bodies, responses):
        if response.status == 200:  # the batch answers each as it answers the request alone
            assert_same_answer(json.loads(response.body), call(svc, route, body)[1])


def assert_same_answer(got, want):
    """The same answer but for float32 rounding (passes padded differently): same keys, lengths,
    token ids; numbers within 1e-5."""
    if isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            assert_same_answer(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for one, other in zip(got, want):
            assert_same_answer(one, other)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5)
    elif isinstance(want, str) and len(want) > 100:  # a base64 vector
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(got), "<f4"),
                                   np.frombuffer(base64.b64decode(want), "<f4"), atol=1e-5)
    else:
        assert got == want


def test_an_answer_over_the_bound_is_413_naming_encoding_format_and_outputs(staged):
    texts = TEXTS[:8]
    small = assemble(staged, Settings(dtype="float32", max_response_bytes=100_000), model_name="m3", warm=False)
    assert call(small, "", {"input": texts})[0] == 200  # the dense vectors fit
    status, answer = call(small, "", {"input": texts, "outputs": ALL})
    assert status == 413, answer
    message = answer["error"]["message"]
    assert "encoding_format" in message and "'outputs'" in message and "max_response_bytes=100000" in message
    assert answer["error"]["param"] == "input"
    status, answer = call(small, "", {"input": texts, "outputs": ALL, "encoding_format": "base64"})
    assert status == 200, answer  # the remedy it names: base64 ColBERT vectors take a third


def test_info_says_hybrid_and_lists_the_routes(svc):
    info = svc.info()
    assert info["task"] == "hybrid" and info["model_type"] == "embedding"
    assert info["routes"] == ["", "v1/embeddings", "embed", "embed_sparse"]
    assert info["embedding_dimension"] == 32 and info["pooling"] == "cls" and info["model_dtype"] == "float32"
    assert info["modules"] == ["Transformer", "Pooling(cls)", "Normalize", "SparseLinear(relu, max by token id)",
                               "ColBERTLinear(32, normalized)"]
    assert info["cache"] == {"memory_entries": 0, "redis": False}


def test_the_openapi_document_is_valid_and_its_bodies_take_outputs(svc):
    document = svc.openapi()
    validate(document)
    paths = document["paths"]
    native = next(path for path in paths if path.endswith("/m3"))
    openai = next(path for path in paths if path.endswith("/v1/embeddings"))
    assert any(path.endswith("/embed") for path in paths) and any(path.endswith("/embed_sparse") for path in paths)
    assert not any(path.endswith("/similarity") for path in paths)
    for path in (native, openai):
        schema = json.dumps(paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"])
        assert '"outputs"' in schema and '"colbert"' in schema and '"max_active_dims"' in schema, path


def test_the_reference_loads_again_in_the_same_process(reference):
    """A build in process (archive/smoke.py's _compare_m3) and reference_m3 each load FlagEmbedding's
    M3Embedder: the second load must find it too, or the build compares nothing ("not compared")."""
    assert m3_embedder_class() is m3_embedder_class()


@pytest.mark.parametrize("body, param", [
    ({"input": "a", "outputs": ["sparse"], "dimensions": 1000}, "dimensions"),
    ({"input": "a", "outputs": ["colbert"], "output_dtype": "int8", "normalize": False}, "output_dtype"),
])
def test_the_embedding_options_are_checked_whatever_outputs_ask(svc, body, param):
    """As the OpenAPI document bounds them: a value it refuses is refused without the dense vector too."""
    status, answer = call(svc, "", body)
    assert status == 400 and answer["error"]["param"] == param, answer
