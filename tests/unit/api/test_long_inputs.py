"""Inputs longer than the model, "long_input": "chunk", in process: windows of the model's length,
each through the model's pipeline, combined by their text tokens, then normalized, against the
reference of tests/support/long_inputs.py; the options' bad values, the limits, the cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.settings import Settings
from tests.support.inputs import varied_texts
from tests.support.long_inputs import LONG, call, cosine, reference
from tests.support.sparse_models import make_splade


@pytest.mark.parametrize("overlap", [0, 7])
def test_a_long_text_is_the_weighted_mean_of_its_windows(service, st_model, overlap):
    max_length = service.text.max_length
    expected, windows = reference(st_model, LONG, max_length, overlap)
    assert windows >= 5
    status, answer = call(service, "v1/embeddings", {"input": [LONG, "a short text"], "long_input": "chunk",
                                                     "chunk_overlap": overlap})
    assert status == 200, answer
    [long, short] = answer["data"]
    assert long["windows"] == windows and short["windows"] == 1
    assert cosine(long["embedding"], expected) >= 0.99999
    assert abs(np.linalg.norm(long["embedding"]) - 1) < 1e-5
    # usage counts every window's tokens: what the model computed
    assert answer["usage"]["prompt_tokens"] > windows * (max_length - 2 - overlap)


def test_a_prompt_is_in_every_window(service, st_model):
    expected, windows = reference(st_model, LONG, service.text.max_length, prompt="query: ")
    status, answer = call(service, "", {"input": LONG, "long_input": "chunk", "prompt_name": "query"})
    assert status == 200 and answer["data"][0]["windows"] == windows
    assert cosine(answer["data"][0]["embedding"], expected) >= 0.99999


def test_an_input_that_fits_is_what_truncation_gives_to_the_bit(service):
    texts = ["a short text", "another one"]
    _, plain = call(service, "v1/embeddings", {"input": texts, "encoding_format": "base64"})
    _, chunked = call(service, "v1/embeddings", {"input": texts, "encoding_format": "base64", "long_input": "chunk"})
    assert [d["embedding"] for d in chunked["data"]] == [d["embedding"] for d in plain["data"]]
    assert "windows" not in plain["data"][0]  # the default answer is unchanged


def test_truncation_stays_the_default(service):
    _, truncated = call(service, "v1/embeddings", {"input": LONG})
    _, chunked = call(service, "v1/embeddings", {"input": LONG, "long_input": "chunk"})
    assert cosine(truncated["data"][0]["embedding"], chunked["data"][0]["embedding"]) < 0.9999
    status, refused = call(service, "v1/embeddings", {"input": LONG, "truncate": False})
    assert status == 413
    status, _ = call(service, "v1/embeddings", {"input": LONG, "truncate": False, "long_input": "chunk"})
    assert status == 200  # nothing is cut


def test_token_id_inputs_and_tei_and_dimensions(service, st_model):
    # ids inside the tiny vocabulary's counted range (its word pieces of digits come after it)
    text = "".join(char for char in LONG.encode("ascii", "ignore").decode() if not char.isdigit())
    ids = service.text.tokenizer.body_ids([text])[0]
    _, from_text = call(service, "v1/embeddings", {"input": text, "long_input": "chunk", "dimensions": 16})
    status, from_ids = call(service, "v1/embeddings", {"input": [ids], "long_input": "chunk", "dimensions": 16})
    assert status == 200, from_ids
    assert np.allclose(from_text["data"][0]["embedding"], from_ids["data"][0]["embedding"], atol=1e-6)
    assert len(from_text["data"][0]["embedding"]) == 16
    status, tei = call(service, "embed", {"inputs": [text], "long_input": "chunk", "dimensions": 16})
    assert status == 200 and np.allclose(tei[0], from_text["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize("body, status, param, words", [
    ({"long_input": "split"}, 400, "long_input", "must be one of truncate, chunk"),
    ({"long_input": "chunk", "chunk_overlap": -1}, 400, "chunk_overlap", "at least 0"),
    ({"long_input": "chunk", "chunk_overlap": 44}, 400, "chunk_overlap", "must be at most 43"),
    ({"long_input": "chunk", "chunk_overlap": "3"}, 400, "chunk_overlap", "integer"),
])
def test_bad_options_are_refused_naming_the_field(service, body, status, param, words):
    got, answer = call(service, "v1/embeddings", {"input": LONG, **body})
    assert got == status, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_the_windows_count_in_the_request_limits(tiny_model_dir):
    small = assemble(tiny_model_dir, Settings(dtype="float32", max_tokens_per_request=200), model_name="tiny",
                     warm=False)
    status, answer = call(small, "v1/embeddings", {"input": LONG, "long_input": "chunk"})
    assert status == 413 and "max_tokens_per_request=200" in answer["error"]["message"]
    status, _ = call(small, "v1/embeddings", {"input": LONG})  # truncated, it fits
    assert status == 200


def test_the_largest_overlap_is_the_documents_and_served_with_any_prompt(service, st_model):
    limit = service.openapi()["components"]["schemas"]["EmbeddingRequest"]["properties"]["chunk_overlap"]["maximum"]
    assert limit == service.text.max_chunk_overlap == 43  # 48 less [CLS], [SEP] and the 2-token prompt, less one
    # A step of one token: a window for each token past the first window's, so a text a few windows long.
    text = " ".join(varied_texts(6, seed=3))
    for prompt_name in (None, "query", "document"):
        status, answer = call(service, "v1/embeddings", {"input": text, "long_input": "chunk", "chunk_overlap": limit,
                                                         "prompt_name": prompt_name})
        assert status == 200, answer
        assert answer["data"][0]["windows"] > 10, answer["data"][0]["windows"]


def test_other_requests_of_the_batch_are_unaffected(service):
    bodies = [{"input": LONG, "long_input": "chunk"}, {"input": LONG, "long_input": "chunk", "chunk_overlap": 999},
              {"input": "plain"}]
    raws = [RawRequest(json.dumps(b).encode(), "application/json", "v1/embeddings") for b in bodies]
    statuses = [r.status for r in service.handle(raws)]
    assert statuses == [200, 400, 200]


def test_windows_are_cached_each(tiny_model_dir):
    cached = assemble(tiny_model_dir, Settings(dtype="float32", cache_entries=1000), model_name="tiny", warm=False)
    body = {"input": LONG, "long_input": "chunk", "encoding_format": "base64"}
    raw = RawRequest(json.dumps(body).encode(), "application/json", "v1/embeddings")
    [first], _ = cached.handle_with_report([raw])
    [second], report = cached.handle_with_report([raw])
    assert second.body == first.body and report.cache_misses == 0 and sum(report.cache_hits.values()) >= 5


def test_a_sparse_model_refuses_chunking(tmp_path):
    svc = assemble(make_splade(tmp_path / "sp"), Settings(dtype="float32"), model_name="sp", warm=False)
    status, answer = call(svc, "embed_sparse", {"inputs": [LONG], "long_input": "chunk"})
    assert status == 422 and "a sparse or hybrid model cuts a long input" in answer["error"], answer
    status, _ = call(svc, "embed_sparse", {"inputs": [LONG], "long_input": "truncate"})
    assert status == 200
