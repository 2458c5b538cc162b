"""The images the image benchmarks send, made here (numpy and Pillow alone, so that the GPU
machine's step imports nothing of the served path's load tools): photographs for the image-text
models (bench/images.py, bench/gpu_images.py), document pages for the page retrievers
(bench/pages.py, bench/gpu_images.py). The same files every run."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

IMAGES = 64
SIZE = (640, 480)
PAGES = 32
PAGE_SIZE = (850, 1100)


def photographs() -> list[bytes]:
    """JPEG files of photograph-like content: gradients, blobs of colour, a little noise."""
    rng = np.random.default_rng(0)
    width, height = SIZE
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    files = []
    for _ in range(IMAGES):
        channels = [np.sin(x / rng.uniform(20, 200) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(20, 200))
                    for _ in range(3)]
        pixels = (np.stack(channels, axis=2) * 100 + 128 + rng.normal(0, 6, (height, width, 3))).clip(0, 255)
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8), "RGB").save(buffer, format="JPEG", quality=90)
        files.append(buffer.getvalue())
    return files


def document_pages() -> list[bytes]:
    """PNG files of text pages: lines of dark word-shaped bars on white, a heading, margins."""
    rng = np.random.default_rng(0)
    files = []
    for _ in range(PAGES):
        page = Image.new("RGB", PAGE_SIZE, (255, 255, 255))
        draw = ImageDraw.Draw(page)
        draw.rectangle((80, 70, 80 + int(rng.integers(200, 500)), 100), fill=(20, 20, 20))
        y = 140
        while y < PAGE_SIZE[1] - 90:
            x = 80
            while x < PAGE_SIZE[0] - 120:
                word = int(rng.integers(20, 90))
                draw.rectangle((x, y, x + word, y + 10), fill=tuple(int(v) for v in rng.integers(0, 80, 3)))
                x += word + 12
            y += int(rng.choice([22, 22, 22, 44]))
        buffer = io.BytesIO()
        page.save(buffer, format="PNG")
        files.append(buffer.getvalue())
    return files
