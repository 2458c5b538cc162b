"""Output dtypes per request: float, int8, uint8, binary, ubinary.

binary/ubinary are sentence-transformers' `quantize_embeddings`: one bit per dimension (1 where the
value is > 0), packed 8 to a byte along each row (the last byte zero-padded when the dimension
is not a multiple of 8); `binary` shifts each byte by -128 into int8.

int8/uint8 are sentence-transformers' scalar quantization with a fixed, calibration-free range
of [-1, 1] for every dimension, which is exactly the range of a unit vector's components:
    uint8 = clip(floor((x + 1) / (2 / 255)), 0, 255),  int8 = uint8 - 128
So a vector's codes never depend on what else was in the batch. They need normalized vectors;
with normalize off a vector is not unit length (even for a model whose pipeline ends in Normalize,
which then is skipped), so int8/uint8 are refused there (tasks/embed.py).
"""

from __future__ import annotations

import numpy as np

OUTPUT_DTYPES = ("float", "int8", "uint8", "binary", "ubinary")
SCALAR_DTYPES = ("int8", "uint8")
_STEP = np.float32(2.0 / 255.0)


def quantize(vectors: np.ndarray, output_dtype: str) -> np.ndarray:
    """(n, d) float32 -> (n, d) float32/int8/uint8 or (n, ceil(d / 8)) packed bits."""
    if output_dtype == "float":
        return vectors
    if output_dtype in SCALAR_DTYPES:
        codes = np.clip(np.floor((vectors + np.float32(1.0)) / _STEP), 0, 255)
        return codes.astype(np.uint8) if output_dtype == "uint8" else (codes - 128).astype(np.int8)
    if output_dtype in ("binary", "ubinary"):
        bits = np.packbits(vectors > 0, axis=-1)
        return bits if output_dtype == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)
    raise ValueError(f"unknown output dtype '{output_dtype}'; known: {', '.join(OUTPUT_DTYPES)}")
