"""Sparse (SPLADE) models in process: what the folder says, the pooling against
sentence-transformers' SparseEncoder (max and sum, relu and log1p_relu, BERT and XLM-R), the
bounded blocks of vocabulary logits, the routes' bodies, options and bad inputs, and the answer's
size bound."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.model.description import ModelFilesError, SparsePooling, Task
from embedserve.handler.model.files import describe_model
from embedserve.handler.model.inputs import TokenRole, plain_inputs
from embedserve.handler.model.sparse import SpladePooler
from embedserve.handler.settings import Settings
from tests.support.model_families import corpus
from embedserve.archive.stage import StageError, stage_model
from tests.support.sparse_models import (assert_same_sparse, make_inference_free, make_splade, reference_sparse,
                                         served_sparse)

SHAPES = {"bert-max-relu": ("bert", "max", "relu"), "bert-sum-log1p": ("bert", "sum", "log1p_relu"),
          "xlmr-max-relu": ("xlmr", "max", "relu")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse")
    return {name: make_splade(root / name, family=family, strategy=strategy, activation=activation)
            for name, (family, strategy, activation) in SHAPES.items()}


@pytest.fixture(scope="module")
def services(models):
    return {name: assemble(path, Settings(dtype="float32"), model_name="sp", warm=True) for name, path in models.items()}


def call(svc, route, body, content_type="application/json"):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    [response] = svc.handle([RawRequest(raw, content_type, route)])
    return response.status, json.loads(response.body)


def test_the_folder_says_sparse_with_its_pooling_and_vocabulary(models):
    description = describe_model(models["bert-sum-log1p"])
    assert description.task is Task.SPARSE
    assert description.sparse == SparsePooling("sum", "log1p_relu", description.dimension)
    assert description.modules == ["Transformer(masked LM)", "SpladePooling(sum, log1p_relu)"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_served_vectors_are_sparse_encoder_s(models, services, name):
    texts = corpus(48, seed=5) + ["a", "hello world " * 60]  # one past max_seq_length: truncated alike
    status, answer = call(services[name], "embed_sparse", {"inputs": texts})
    assert status == 200
    assert_same_sparse(served_sparse(answer), reference_sparse(models[name], texts))


def test_blocks_of_logits_give_the_unblocked_answer():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(5, 13, 8)
    mask = torch.ones(5, 13, dtype=torch.int64)
    mask[1, 6:] = TokenRole.PAD
    mask[3, 2:] = TokenRole.PAD
    for strategy in ("max", "sum"):
        pooling = SparsePooling(strategy, "relu", 50)
        whole = SpladePooler(head, pooling, chunk_values=10**9)(hidden, mask)
        blocks = SpladePooler(head, pooling, chunk_values=50 * 2)(hidden, mask)  # 2 inputs x 1 position a block
        torch.testing.assert_close(blocks, whole)
        padded_out = SpladePooler(head, pooling)(hidden[1:2, :6], mask[1:2, :6])
        torch.testing.assert_close(whole[1:2], padded_out)  # padding weighs nothing


def test_native_route_formats_and_options(services):
    svc = services["bert-max-relu"]
    text = "the quick brown fox jumps over the lazy dog"
    _, [full] = call(svc, "embed_sparse", {"inputs": [text]})
    weights = {entry["index"]: entry["value"] for entry in full}
    status, answer = call(svc, "", {"input": text})
    assert status == 200 and answer["data"][0]["object"] == "sparse_embedding"
    embedding = answer["data"][0]["embedding"]
    assert embedding["indices"] == sorted(weights) and embedding["values"] == [weights[i] for i in sorted(weights)]
    assert answer["usage"]["prompt_tokens"] > 0

    largest = sorted(weights, key=weights.get, reverse=True)[:5]
    _, answer = call(svc, "", {"input": [text], "max_active_dims": 5})
    assert answer["data"][0]["embedding"]["indices"] == sorted(largest)
    cut = sorted(weights.values())[len(weights) // 2]
    _, answer = call(svc, "", {"input": text, "threshold": cut})
    assert answer["data"][0]["embedding"]["indices"] == sorted(i for i, w in weights.items() if w >= cut)

    _, answer = call(svc, "", {"input": text, "sparse_format": "tokens"})
    by_token = answer["data"][0]["embedding"]
    backend = svc.text.tokenizer.backend
    assert by_token == {backend.id_to_token(i): w for i, w in weights.items()}

    status, answer = call(svc, "", text, content_type="text/plain")
    assert status == 200 and answer["data"][0]["embedding"]["indices"] == sorted(weights)


@pytest.mark.parametrize("route,body,status,param", [
    ("", {"input": "a", "threshold": -1}, 400, "threshold"),
    ("", {"input": "a", "threshold": True}, 400, "threshold"),
    ("", {"input": "a", "max_active_dims": 0}, 400, "max_active_dims"),
    ("", {"input": "a", "sparse_format": "csr"}, 400, "sparse_format"),
    ("", {"input": [[1, 2]]}, 400, "input[0]"),  # token ids: not on a sparse route
    ("", {"inputs": "a"}, 400, "input"),
    ("", {"input": "a", "prompt_name": "nope"}, 400, "prompt_name"),
    ("", {"input": "a " * 200, "truncate": False}, 413, "input[0]"),
    ("embed_sparse", {"inputs": "a", "sparse_format": "tokens"}, 400, None),
    ("embed_sparse", {"inputs": []}, 400, None),
])
def test_bad_requests_name_the_field(services, route, body, status, param):
    got, answer = call(services["bert-max-relu"], route, body)
    assert got == status, answer
    if route:  # TEI's shape
        assert answer["error_type"] and answer["error"]
    else:
        assert answer["error"]["param"] == param, answer


def test_openai_s_route_answers_the_native_list_and_dense_routes_404(services):
    svc = services["bert-max-relu"]
    body = {"input": ["a cat", "a dog"], "model": "sp", "encoding_format": "base64"}  # the openai client's
    status, answer = call(svc, "v1/embeddings", body)
    assert status == 200 and answer["data"] == call(svc, "", {"input": ["a cat", "a dog"]})[1]["data"]
    status, answer = call(svc, "v1/embeddings", {**body, "encoding_format": "hex"})
    assert status == 400 and answer["error"]["param"] == "encoding_format"
    status, answer = call(svc, "embed", {"inputs": "a"})
    assert status == 404 and "sparse model" in answer["error"] and "'v1/embeddings'" in answer["error"]


def test_a_bad_request_fails_alone_in_its_batch(services):
    svc = services["bert-max-relu"]
    raws = [RawRequest(json.dumps(body).encode(), "application/json", route) for route, body in (
        ("embed_sparse", {"inputs": ["one text"]}), ("", {"input": "x", "threshold": "high"}),
        ("", {"input": ["two", "texts"]}))]
    statuses = [response.status for response in svc.handle(raws)]
    assert statuses == [200, 400, 200]


def test_an_answer_over_the_bound_is_413_naming_the_remedy(models):
    svc = assemble(models["bert-max-relu"], Settings(dtype="float32", max_response_bytes=2000), model_name="sp",
                   warm=False)
    status, answer = call(svc, "", {"input": corpus(8, seed=1)})
    assert status == 413 and "max_active_dims" in answer["error"]["message"]
    status, answer = call(svc, "", {"input": corpus(8, seed=1), "max_active_dims": 1000})
    assert status == 413 and "max_response_bytes=2000" in answer["error"]["message"]  # refused before any work
    assert call(svc, "", {"input": "a", "max_active_dims": 2})[0] == 200


def test_info_and_openapi_say_what_the_model_serves(services):
    svc = services["bert-max-relu"]
    info = svc.info()
    assert info["task"] == "sparse" and info["routes"] == ["", "v1/embeddings", "embed_sparse"]
    assert info["pooling"] == "SpladePooling(max, relu)" and info["model_type"] == "embedding"
    assert info["cache"] == {"memory_entries": 0, "redis": False}
    paths = svc.openapi()["paths"]
    assert any(path.endswith("/1.0/embed_sparse") for path in paths)
    assert any(path.endswith("/1.0/v1/embeddings") for path in paths)
    assert not any(path.endswith("/embed") for path in paths)
    assert "SparseEmbeddingList" in svc.openapi()["components"]["schemas"]


def test_other_sparse_pipelines_are_refused_by_name(models, tmp_path):
    folder = shutil.copytree(models["bert-max-relu"], tmp_path / "router")
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["type"] = "sentence_transformers.base.modules.router.Router"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelFilesError, match="sparse encoder with modules"):
        describe_model(folder)
    config = json.loads((models["bert-max-relu"] / "1_SpladePooling" / "config.json").read_text())
    (folder / "modules.json").write_text((models["bert-max-relu"] / "modules.json").read_text())
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps({**config, "pooling_strategy": "mean"}))
    with pytest.raises(ModelFilesError, match="pooling_strategy 'mean'"):
        describe_model(folder)


def test_the_encoder_keeps_only_non_zero_entries_by_ascending_id(services):
    svc = services["xlmr-max-relu"]
    embedded = svc.encoder.embed(plain_inputs(svc.text.checks.text.token_ids(["hello world", "a"])))
    assert isinstance(embedded.vectors, list) and all(row.shape[0] == 2 for row in embedded.vectors)
    assert all((row[1] > 0).all() and np.all(np.diff(row[0]) > 0) for row in embedded.vectors)


def test_an_inference_free_model_looks_queries_up_without_a_pass(tmp_path):
    source = make_inference_free(tmp_path / "inference-free")
    staged = tmp_path / "staged"
    stage_model(source, staged)  # the build lays the Router's two sides out (archive/stage.py)
    svc = assemble(staged, Settings(dtype="float32"), model_name="sp", warm=True)
    assert svc.info()["modules"][0] == "SparseStaticEmbedding(queries)"
    texts = corpus(24, seed=9) + ["a", "hello hello world"]
    for kind in ("query", "document", None):
        body = {"input": texts, **({"input_type": kind} if kind else {})}
        responses, report = svc.handle_with_report([RawRequest(json.dumps(body).encode(), "application/json", "")])
        got = [dict(zip(item["embedding"]["indices"], item["embedding"]["values"]))
               for item in json.loads(responses[0].body)["data"]]
        assert_same_sparse(got, reference_sparse(source, texts, kind=kind))
        assert (report.forward_passes == 0) == (kind == "query")  # a query costs a lookup
    status, answer = call(svc, "embed_sparse", {"inputs": texts[:2], "input_type": "query", "max_active_dims": 2})
    assert status == 200 and all(len(row) <= 2 for row in answer)
    assert call(svc, "", {"input": "a", "input_type": "passage"})[0] == 400


def test_a_router_of_other_sides_is_refused(tmp_path):
    source = make_inference_free(tmp_path / "inference-free")
    config = json.loads((source / "router_config.json").read_text())
    config["parameters"]["default_route"] = "query"
    (source / "router_config.json").write_text(json.dumps(config))
    with pytest.raises(StageError, match="SparseStaticEmbedding query side"):
        stage_model(source, tmp_path / "staged")
