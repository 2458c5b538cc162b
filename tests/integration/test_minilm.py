"""The real all-MiniLM-L6-v2 through TorchServe against sentence-transformers in-process."""

import numpy as np
import pytest
import requests

from embedserve.archive.bf16_check import BF16_MIN_COSINE
from embedserve.archive.default_model import fetch_default_model
from tests.support.inputs import varied_texts

pytestmark = pytest.mark.integration


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
    # The build's default dtype: float32, or bfloat16 where this CPU's bf16 units measured faster.
    dtype = requests.get(f"{server.url('inference')}/predictions/minilm/1.0/info", headers=server.auth(),
                         timeout=30).json()["model_dtype"]
    bar = {"float32": 0.9999, "bfloat16": BF16_MIN_COSINE}[dtype]
    assert cosine.min() >= bar, f"{dtype}: min cosine {cosine.min():.6f} at {int(cosine.argmin())}"
