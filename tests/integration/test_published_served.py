"""Models made from their published files (tests/support/published.py: the published config,
sentence-transformers and tokenizer-config files, small random weights of the published names
and vocabulary), built by build_mar as a user builds a downloaded folder, served by the real
TorchServe in its default dtype setting pinned to float32, against sentence-transformers on
the same folder (for nomic-embed-text-v1.5 and gte-base-en-v1.5, published in their original
remote-code layout, on transformers' native port of the same weights): every prompt the model publishes, on the OpenAI route; the reranker against
CrossEncoder.predict; the ColBERT model (PyLate's layout) against MultiVectorEncoder, queries,
documents past max_seq_length and inputs of neither type."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from tests.support.model_families import TEXTS, min_cosine
from tests.support.published import EMBEDDERS, MULTI_VECTOR, RERANKERS, make_published, reference_folder
from tests.support.rerankers import PAIRS, reference_scores
from tests.support.serving import FLOAT32, serving

pytestmark = pytest.mark.integration

MIN_COSINE = 0.99999
MAX_SCORE_DIFFERENCE = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    return {slug: make_published(slug, root / slug) for slug in (*EMBEDDERS, *RERANKERS, *MULTI_VECTOR)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders):
    builds = [[*FLOAT32, "--model", str(path), "--name", slug, "--workers", "1"] for slug, path in folders.items()]
    with serving(tmp_path_factory.mktemp("published-torchserve"), *builds) as ts:
        yield ts


def post(server, slug, route, body):
    url = f"{server.url('inference')}/predictions/{slug}" + (f"/1.0/{route}" if route else "")
    response = requests.post(url, json=body, headers=server.auth(), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("slug", EMBEDDERS)
def test_a_published_embedder_serves_sentence_transformers_vectors(server, folders, slug):
    from sentence_transformers import SentenceTransformer
    import torch

    reference = SentenceTransformer(str(reference_folder(folders[slug])), device="cpu",
                                    model_kwargs={"dtype": torch.float32})
    info = requests.get(f"{server.url('inference')}/predictions/{slug}/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["embedding_dimension"] == reference.get_embedding_dimension()
    settings = folders[slug] / "config_sentence_transformers.json"  # not every model publishes one
    published = (json.loads(settings.read_text()).get("prompts") if settings.is_file() else None) or {}
    assert info["prompts"] == published
    for name in [None, *published]:
        option = {"prompt_name": name} if name else {}
        got = np.array([row["embedding"] for row in post(server, slug, "v1/embeddings",
                                                          {"input": TEXTS, **option})["data"]])
        assert min_cosine(got, reference.encode(TEXTS, prompt_name=name)) >= MIN_COSINE, (slug, name)


@pytest.mark.parametrize("slug", RERANKERS)
def test_a_published_reranker_scores_as_cross_encoder(server, folders, slug):
    got = post(server, slug, "predict", {"inputs": [list(pair) for pair in PAIRS]})
    want = reference_scores(folders[slug])
    assert np.abs(np.array([row[0]["score"] for row in got]) - want).max() <= MAX_SCORE_DIFFERENCE


@pytest.mark.parametrize("slug", MULTI_VECTOR)
def test_a_published_colbert_serves_multi_vector_encoder_token_vectors(server, folders, slug):
    from sentence_transformers import MultiVectorEncoder
    import torch

    reference = MultiVectorEncoder(str(folders[slug]), device="cpu", model_kwargs={"dtype": torch.float32})
    texts = [*TEXTS, "the long document " * 120]  # past max_seq_length (299), within document_length (300)
    for kind, encode in (("query", reference.encode_query), ("document", reference.encode_document),
                         (None, reference.encode)):
        answer = post(server, slug, "", {"input": texts, **({"input_type": kind} if kind else {})})
        for item, want in zip(answer["data"], encode(texts, convert_to_numpy=True)):
            got = np.asarray(item["embedding"], dtype=np.float64).reshape(-1, want.shape[1])
            assert got.shape == want.shape and min_cosine(got, want) >= MIN_COSINE, (kind, got.shape, want.shape)
