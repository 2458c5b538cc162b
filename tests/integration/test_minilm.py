"""The real all-MiniLM-L6-v2 through TorchServe against sentence-transformers in-process."""

import random

import numpy as np
import pytest
import requests

from embedserve.archive.default_model import fetch_default_model

pytestmark = pytest.mark.integration

SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome!",
    "Embeddings map text to vectors that capture meaning.",
    "¿Dónde está la biblioteca?",
    "Ich liebe maschinelles Lernen und große Sprachmodelle.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "emoji 🚀🔥 and symbols ∑∫√ mixed with text",
    "x",
    "OK",
    "   leading and trailing spaces   ",
    "Line one\nLine two\tTabbed",
    "URLs like https://example.com/path?q=1 and e-mails like a@b.co",
    "Numbers 3.14159 2.71828 1e-10 and 42",
]


def varied_texts(count=120, seed=7):
    """Short, long (past the 256-token limit) and non-ASCII texts, deterministic."""
    rng = random.Random(seed)
    words = " ".join(SENTENCES).split()
    texts = list(SENTENCES)
    while len(texts) < count:
        length = rng.choice([1, 3, 8, 20, 60, 150, 400])
        texts.append(" ".join(rng.choice(words) for _ in range(length)))
    return texts


def test_minilm_matches_sentence_transformers(server):
    from sentence_transformers import SentenceTransformer

    texts = varied_texts()
    assert len(texts) >= 100 and any(len(t.split()) > 300 for t in texts)
    expected = SentenceTransformer(str(fetch_default_model()), device="cpu").encode(
        texts, normalize_embeddings=True, batch_size=32)

    got = []
    for start in range(0, len(texts), 40):
        response = requests.post(f"{server.url('inference')}/predictions/minilm",
                                 json={"input": texts[start:start + 40]}, headers=server.auth(), timeout=120)
        assert response.status_code == 200, response.text
        got.extend(d["embedding"] for d in response.json()["data"])
    got = np.array(got)
    assert got.shape == (len(texts), 384)
    cosine = (got * expected).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, f"min cosine {cosine.min():.6f} at {int(cosine.argmin())}"
