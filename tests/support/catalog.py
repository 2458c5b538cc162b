"""The session's catalog: the tiny sparse (SPLADE), hybrid (bge-m3), multi-vector (ColBERT),
image-text (CLIP, SigLIP, SigLIP 2 NaFlex) and page retriever (ColPali, ColQwen2) models, served by one real TorchServe built as a user builds them (the model and its name, one
worker each). The served tests of those outputs and their OpenAPI fuzzing share it
(tests/conftest.py): a server of its own only where a test needs a server-wide property."""

from __future__ import annotations

from pathlib import Path

from tests.support.image_models import make_clip, make_siglip, make_siglip2
from tests.support.m3_models import make_m3
from tests.support.multi_vector_models import make_colbert
from tests.support.page_models import make_colpali, make_colqwen2
from tests.support.sparse_models import make_inference_free, make_splade

# The SPLADE shapes served: BERT with max pooling, XLM-R with sum pooling and log1p_relu.
SPARSE_SHAPES = {"splade": ("bert", "max", "relu"), "splade-xlmr": ("xlmr", "sum", "log1p_relu")}
SPARSE = (*SPARSE_SHAPES, "splade-free")  # and an inference-free model (queries looked up)
HYBRID = "m3"
MULTI_VECTOR = "colbert"
IMAGE_TEXT = "clip"
SIGLIP = "siglip"
NAFLEX = "siglip2"  # SigLIP 2's variable-resolution model: an image keeps its aspect ratio
PAGES = "colpali"
PAGES_BY_SIZE = "colqwen2"  # a page retriever whose pages keep their own sizes


def make_catalog_models(root: Path) -> dict[str, Path]:
    """Each served name's model folder, made in `root`."""
    models = {name: make_splade(root / name, family=family, strategy=strategy, activation=activation)
              for name, (family, strategy, activation) in SPARSE_SHAPES.items()}
    models["splade-free"] = make_inference_free(root / "splade-free")
    models[HYBRID] = make_m3(root / "bge-m3")
    models[MULTI_VECTOR] = make_colbert(root / "colbert")
    models[IMAGE_TEXT] = make_clip(root / "clip")
    models[SIGLIP] = make_siglip(root / "siglip")
    models[NAFLEX] = make_siglip2(root / "siglip2")
    models[PAGES] = make_colpali(root / "colpali")
    models[PAGES_BY_SIZE] = make_colqwen2(root / "colqwen2")
    return models


# The CLIP fetches image URLs from loopback, where the tests serve images (tests/support/image_host.py);
# the others keep the default: no URL fetched.
BUILD_SETTINGS = {IMAGE_TEXT: ["--set", "image_url_hosts=[127.0.0.1]"]}


def catalog_builds(models: dict[str, Path]) -> list[list[str]]:
    return [["--model", str(path), "--name", name, "--workers", "1", *BUILD_SETTINGS.get(name, [])]
            for name, path in models.items()]
