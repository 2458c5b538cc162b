"""`"normalize": false` as TEI means it, in-process against sentence-transformers: the pooled
vector (after Dense or LayerNorm) before the pipeline's final Normalize; and int8/uint8, which
quantize unit vectors, follow the vectors actually returned."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedserve.handler.api.quantize import quantize
from embedserve.handler.model.description import HeadModule
from embedserve.handler.model.head import without_final_normalize
from embedserve.handler.api.exchange import RawRequest
from tests.support.engines import make_engine
from tests.support.model_families import FAMILIES, MIN_COSINE, TEXTS, min_cosine
from tests.support.pipelines import normalize_before_dense, without_normalize


def call(engine, body) -> tuple[int, dict]:
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", "")])
    return response.status, json.loads(response.body)


def served(engine, body) -> np.ndarray:
    status, answer = call(engine, body)
    assert status == 200, answer
    return np.array([row["embedding"] for row in answer["data"]], dtype=np.float64)


def assert_same_vectors(got, want) -> None:
    """Same direction and same length: min cosine and the norms to float32's precision."""
    assert got.shape == want.shape and min_cosine(got, want) >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=2e-4)


@pytest.fixture(scope="module")
def engines(families):
    return {family: make_engine(path) for family, path in families.items()}


@pytest.mark.parametrize("family", FAMILIES)  # every family's pipeline ends in Normalize
def test_normalize_false_is_the_vector_before_the_final_normalize(family, families, engines, tmp_path):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(without_normalize(families[family], tmp_path / family)), device="cpu")
    want = reference.encode(TEXTS, normalize_embeddings=False)
    assert not np.allclose(np.linalg.norm(want, axis=1), 1.0, atol=1e-3)  # a real difference to find
    got = served(engines[family], {"input": TEXTS, "normalize": False})
    assert_same_vectors(got, want)
    # The default is the pipeline's own unit vectors; dimensions cut the vector before normalizing it.
    unit = served(engines[family], {"input": TEXTS})
    assert_same_vectors(unit, want / np.linalg.norm(want, axis=1, keepdims=True))
    cut = served(engines[family], {"input": TEXTS, "dimensions": 16, "normalize": False})
    assert_same_vectors(cut, want[:, :16])


def test_a_normalize_that_modules_follow_still_runs(families, tmp_path):
    """Pooling, Normalize, Dense: only a final Normalize is the answer's to skip."""
    from sentence_transformers import SentenceTransformer

    model = normalize_before_dense(families["bert_dense"], tmp_path / "reordered")
    want = SentenceTransformer(str(model), device="cpu").encode(TEXTS, normalize_embeddings=False)
    engine = make_engine(model)
    assert engine.info()["modules"] == ["Transformer", "Pooling(cls)", "Normalize", "Dense(32->24, Tanh)"]
    assert_same_vectors(served(engine, {"input": TEXTS, "normalize": False}), want)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_int8_follows_the_vectors_returned(engines, dtype):
    engine = engines["xlmr"]
    status, answer = call(engine, {"input": TEXTS, "output_dtype": dtype, "normalize": False})
    assert status == 400 and answer["error"]["param"] == "output_dtype"  # 422 on TEI routes
    assert "not unit length" in answer["error"]["message"]
    # Normalized (the default), the codes are those of the unit vectors served as floats.
    codes = served(engine, {"input": TEXTS, "output_dtype": dtype})
    unit = served(engine, {"input": TEXTS}).astype(np.float32)
    assert np.abs(codes - quantize(unit, dtype).astype(np.float64)).max() <= 1  # float32 rounding at a step's edge


def test_the_encoder_runs_all_but_a_final_normalize():
    dense, normalize = HeadModule("Dense", "2_Dense"), HeadModule("Normalize", "3_Normalize")
    assert without_final_normalize([dense, normalize]) == [dense]
    assert without_final_normalize([normalize, dense]) == [normalize, dense]
    assert without_final_normalize([normalize]) == []
