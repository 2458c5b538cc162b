"""Image files for the image kind's tests: real files Pillow writes, as data URIs, and a PNG written
chunk by chunk whose header claims what its data need not hold (a decompression bomb)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_file(image: Image.Image, file_format: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=file_format, **save)
    return buffer.getvalue()


def photo(width: int = 64, height: int = 48) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def png_of_zeros(width: int, height: int, rows: int | None = None) -> bytes:
    """A 1-bit greyscale PNG, written chunk by chunk: `rows` of its rows' data (all by default)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" * (1 + -(-width // 8))  # filter byte, then the row's bits
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(row) for _ in range(height if rows is None else rows)) + compressor.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))
