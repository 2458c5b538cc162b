"""Original remote-code layouts (nomic-bert, GTE "new", Arctic-embed-m-v2.0 shapes) built by build_mar
as a user builds them, which rewrites them for transformers' native classes, served by a real
TorchServe and checked through the official OpenAI client, with prompt_name and dimensions, against
sentence-transformers on the native model."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import openai
import pytest
import requests

from tests.support.model_families import TEXTS, min_cosine
from tests.support.native_models import NATIVE_FAMILIES, make_native_and_original
from tests.support.serving import FLOAT32, serving

pytestmark = pytest.mark.integration

MIN_COSINE = 0.99999
CLASSES = {"nomic": "NomicBertModel", "gte": "GteModel", "arctic": "GteModel"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {family: make_native_and_original(family, root) for family in NATIVE_FAMILIES}


@pytest.fixture(scope="module")
def served(tmp_path_factory, models):
    """(the server, the builds' log): the ORIGINAL folders, one worker each for the test's 2 cores."""
    builds = [[*FLOAT32, "--model", str(original), "--name", family, "--workers", "1"]
              for family, (_, original) in models.items()]
    log = io.StringIO()
    with contextlib.redirect_stderr(log), serving(tmp_path_factory.mktemp("native-torchserve"), *builds) as ts:
        yield ts, log.getvalue()


@pytest.fixture(scope="module")
def references(models):
    from sentence_transformers import SentenceTransformer

    return {family: SentenceTransformer(str(native), device="cpu") for family, (native, _) in models.items()}


def test_the_build_says_which_native_class_serves_each(served):
    _, log = served
    for family, name in CLASSES.items():
        assert f"served by transformers' native {name}" in log
    assert log.count("whose code is never run") == len(CLASSES)


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_openai_route_with_prompts_and_dimensions_is_sentence_transformers(served, references, family):
    server, _ = served
    reference = references[family]
    info = requests.get(f"{server.url('inference')}/predictions/{family}/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["model_class"] == CLASSES[family] and info["architecture"] == ("nomic_bert" if family == "nomic"
                                                                                 else "gte")
    if family == "nomic":
        assert info["prompts"] == {"query": "search_query: ", "document": "search_document: "}
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/{family}/1.0/v1",
                           api_key=server.keys()["inference"], max_retries=0)
    least = 1.0
    for name in [None, *info["prompts"]]:
        option = {"prompt_name": name} if name else {}
        for dimensions in (None, 16):
            result = client.embeddings.create(model=family, input=TEXTS, extra_body=option,
                                              **({"dimensions": dimensions} if dimensions else {}))
            got = np.array([row.embedding for row in result.data])
            want = reference.encode(TEXTS, prompt_name=name, truncate_dim=dimensions, normalize_embeddings=True)
            assert got.shape == want.shape
            least = min(least, min_cosine(got, want))
    print(f"{family} ({info['engine']}): 1 - least cosine to sentence-transformers {1 - least:.1e}")
    assert least >= MIN_COSINE, family
