import numpy as np
import pytest
from sentence_transformers.quantization import quantize_embeddings

from embedserve.handler.api.quantize import quantize


@pytest.fixture
def unit_vectors():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((50, 64)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


@pytest.mark.parametrize("dtype", ["binary", "ubinary"])
def test_bits_match_sentence_transformers(unit_vectors, dtype):
    np.testing.assert_array_equal(quantize(unit_vectors, dtype), quantize_embeddings(unit_vectors, dtype))


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_scalar_codes_are_sentence_transformers_with_the_fixed_unit_range(unit_vectors, dtype):
    ranges = np.stack([np.full(64, -1.0), np.full(64, 1.0)]).astype(np.float32)
    want = quantize_embeddings(unit_vectors, dtype, ranges=ranges)
    np.testing.assert_array_equal(quantize(unit_vectors, dtype), want)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_scalar_codes_do_not_depend_on_batch_mates(unit_vectors, dtype):
    alone = np.concatenate([quantize(unit_vectors[i : i + 1], dtype) for i in range(len(unit_vectors))])
    np.testing.assert_array_equal(alone, quantize(unit_vectors, dtype))


def test_int8_keeps_cosine(unit_vectors):
    codes = quantize(unit_vectors, "int8").astype(np.float32) + 128.5  # bin centres
    restored = codes * (2 / 255) - 1
    cosine = (restored * unit_vectors).sum(1) / np.linalg.norm(restored, axis=1)
    assert cosine.min() > 0.99


def test_extremes_and_dtypes():
    vectors = np.array([[-1.0, -0.5, 0.0, 0.5, 1.0]], dtype=np.float32)
    uint8 = quantize(vectors, "uint8")
    assert uint8.dtype == np.uint8 and quantize(vectors, "int8").dtype == np.int8
    assert uint8[0, 0] == 0 and uint8[0, -1] >= 254  # the whole code range is used
    assert (np.diff(uint8[0].astype(int)) > 0).all()
    np.testing.assert_array_equal(quantize(vectors, "int8").astype(int), uint8.astype(int) - 128)


def test_bits_pad_each_row_when_dimension_is_not_a_multiple_of_8():
    vectors = np.array([[1, -1, 1], [-1, -1, 1]], dtype=np.float32)
    assert quantize(vectors, "ubinary").tolist() == [[0b10100000], [0b00100000]]
    assert quantize(vectors, "binary").tolist() == [[0b10100000 - 128], [0b00100000 - 128]]


def test_float_is_untouched(unit_vectors):
    assert quantize(unit_vectors, "float") is unit_vectors


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown output dtype"):
        quantize(np.zeros((1, 8), np.float32), "int4")
