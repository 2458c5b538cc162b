"""The tiny model's float32 service and its sentence-transformers reference, shared by this
folder's modules that compare served vectors with the reference."""

from __future__ import annotations

import pytest

from embedserve.handler.assembly import assemble
from embedserve.handler.settings import Settings


@pytest.fixture(scope="module")
def service(tiny_model_dir):
    return assemble(tiny_model_dir, Settings(dtype="float32"), model_name="tiny", warm=True)


@pytest.fixture(scope="module")
def st_model(tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(tiny_model_dir), device="cpu")
