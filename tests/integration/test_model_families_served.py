"""Every model family through the real TorchServe, built by build_mar as a user builds it (which
reports the pipeline and checks it against sentence-transformers), against sentence-transformers:
plain inputs, every prompt, inputs over the max length cut on either side, and dimensions, on
the native, OpenAI and TEI routes."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import requests

from tests.support.model_families import FAMILIES, MIN_COSINE, TEXTS, min_cosine, st_on_ids
from tests.support.serving import FLOAT32, serving

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory, families):
    builds = [[*FLOAT32, "--model", str(path), "--name", family, "--workers", "1"] for family, path in families.items()]
    with serving(tmp_path_factory.mktemp("families-torchserve"), *builds) as ts:
        yield ts


def embed(server, family, body, route=""):
    url = f"{server.url('inference')}/predictions/{family}" + (f"/1.0/{route}" if route else "")
    response = requests.post(url, json=body, headers=server.auth(), timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    return np.array([row["embedding"] for row in answer["data"]] if isinstance(answer, dict) else answer), answer


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_sentence_transformers_through_torchserve(server, family, references):
    reference = references[family]
    info = requests.get(f"{server.url('inference')}/predictions/{family}/1.0/info", headers=server.auth(),
                        timeout=60).json()
    prompts = info["prompts"]
    assert info["modules"][0] == "Transformer" and info["modules"][-1] == "Normalize"

    for name in [None, *prompts]:
        option = {"prompt_name": name} if name else {}
        got, _ = embed(server, family, {"input": TEXTS, **option})  # TEXTS[3] is cut at the max length
        assert min_cosine(got, reference.encode(TEXTS, prompt_name=name)) >= MIN_COSINE, (family, name)
        got, _ = embed(server, family, {"input": TEXTS, "dimensions": 16, **option})
        want = reference.encode(TEXTS, prompt_name=name, truncate_dim=16, normalize_embeddings=True)
        assert got.shape == (len(TEXTS), 16) and min_cosine(got, want) >= MIN_COSINE, (family, name)

    # Cut on the left: without a prompt as sentence-transformers cuts; with one, the prompt stays.
    reference.tokenizer.truncation_side = "left"
    try:
        want = reference.encode([TEXTS[3]])
    finally:
        reference.tokenizer.truncation_side = "right"
    got, _ = embed(server, family, {"input": [TEXTS[3]], "truncation_direction": "left"})
    assert min_cosine(got, want) >= MIN_COSINE
    for name, prompt in prompts.items():
        if prompt:
            got, answer = embed(server, family, {"input": [TEXTS[3]], "prompt_name": name,
                                                 "truncation_direction": "left"})
            assert answer["usage"]["prompt_tokens"] == info["max_input_length"]
            assert min_cosine(got, st_on_ids(reference, [left_cut(reference, prompt, TEXTS[3],
                                                                  info["max_input_length"])])) >= MIN_COSINE


def left_cut(reference, prompt, text, max_length):
    """sentence-transformers' tokenization of prompt + text, the text cut on the left, the prompt kept."""
    tokenizer = reference.tokenizer
    full = tokenizer(prompt + text)["input_ids"]
    body = tokenizer(prompt + text, add_special_tokens=False)["input_ids"]
    start = full.index(body[0]) if body else len(full)
    prefix, suffix = full[:start], full[start + len(body):]
    keep = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    room = max_length - len(prefix) - len(suffix) - keep
    return prefix + body[:keep] + body[len(body) - room:] + suffix


def test_openai_client_and_tei_route_serve_the_pipeline(server, references):
    """The Qwen3 shape with its instruction prompt through the official client, and LaBSE's shape
    (a Dense head: 24 dimensions) on TEI's /embed."""
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/qwen3/1.0/v1",
                           api_key=server.keys()["inference"])
    result = client.embeddings.create(model="qwen3", input=TEXTS[:3], extra_body={"prompt_name": "query"})
    got = np.array([row.embedding for row in result.data])
    assert min_cosine(got, references["qwen3"].encode(TEXTS[:3], prompt_name="query")) >= MIN_COSINE

    got, answer = embed(server, "bert_dense", {"inputs": TEXTS[:3]}, route="embed")
    assert got.shape == (3, 24) and min_cosine(got, references["bert_dense"].encode(TEXTS[:3])) >= MIN_COSINE
    raw = requests.post(f"{server.url('inference')}/predictions/bert_dense/1.0/v1/embeddings",
                        json={"input": "hello", "encoding_format": "base64"}, headers=server.auth(), timeout=60)
    assert np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4").shape == (24,)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_serves_a_valid_document_with_its_own_values(server, family):
    """The OpenAPI document of every family's model names its own dimension, length and limits."""
    from openapi_spec_validator import validate

    base = f"{server.url('inference')}/predictions/{family}/1.0"
    document = requests.get(f"{base}/openapi.json", headers=server.auth(), timeout=60).json()
    info = requests.get(f"{base}/info", headers=server.auth(), timeout=60).json()
    validate(document)
    assert document["info"]["x-limits"] == {
        "dimension": info["embedding_dimension"], "max_input_length": info["max_input_length"],
        "max_inputs_per_request": info["max_client_batch_size"], "max_input_chars": info["max_input_chars"],
        "max_tokens_per_request": info["max_tokens_per_request"], "max_response_bytes": info["max_response_bytes"]}
    assert f"/predictions/{family}/1.0/v1/embeddings" in document["paths"]
