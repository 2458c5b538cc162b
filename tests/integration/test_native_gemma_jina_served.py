"""EmbeddingGemma's shape (a bidirectional Gemma3, mean pooling, two Dense layers, Normalize, task
prompts) built by build_mar as a user builds it and served by a real TorchServe, against
sentence-transformers: every prompt and Matryoshka dimensions on the OpenAI route (prompt_name
in extra_body), the native route and TEI's. jina-embeddings-v3's original layout: the build refuses
it, saying what transformers' native port lacks."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import openai
import pytest
import requests

from embedserve.archive.build import main as build_main
from tests.support.model_families import TEXTS, min_cosine
from tests.support.native_models import GEMMA_PROMPTS, JINA_V3_CONFIG, make_embeddinggemma
from tests.support.serving import FLOAT32, make_server_config, serving

pytestmark = pytest.mark.integration

MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return make_embeddinggemma(tmp_path_factory.mktemp("gemma") / "embeddinggemma")


@pytest.fixture(scope="module")
def served(tmp_path_factory, gemma):
    """(the server, the build's log)."""
    log = io.StringIO()
    build = [*FLOAT32, "--model", str(gemma), "--name", "gemma", "--workers", "1"]
    with contextlib.redirect_stderr(log), serving(tmp_path_factory.mktemp("gemma-torchserve"), build) as ts:
        yield ts, log.getvalue()


@pytest.fixture(scope="module")
def reference(gemma):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gemma), device="cpu")


def post(server, route, body):
    response = requests.post(f"{server.url('inference')}/predictions/gemma/1.0/{route}", json=body,
                             headers=server.auth(), timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    return np.array([row["embedding"] for row in answer["data"]] if isinstance(answer, dict) else answer)


def test_embeddinggemma_through_torchserve_is_sentence_transformers(served, reference):
    server, log = served
    # The build's ONNX export of a bidirectional Gemma3 fails (or, exported, is checked exact at build).
    outcome = [line for line in log.splitlines() if line.startswith("ONNX Runtime (the CPU engine):")]
    assert len(outcome) == 1 and ("served by torch" in outcome[0] or "exported" in outcome[0]), log
    info = requests.get(f"{server.url('inference')}/predictions/gemma/1.0/info", headers=server.auth(),
                        timeout=60).json()
    assert info["model_class"] == "Gemma3TextModel" and info["architecture"] == "gemma3_text"
    assert info["prompts"] == GEMMA_PROMPTS and info["modules"][2:4] == ["Dense(32->128, Identity)",
                                                                         "Dense(128->32, Identity)"]
    client = openai.OpenAI(base_url=f"{server.url('inference')}/predictions/gemma/1.0/v1",
                           api_key=server.keys()["inference"], max_retries=0)
    least = 1.0
    for name in [None, *GEMMA_PROMPTS]:
        option = {"prompt_name": name} if name else {}
        for dimensions in (None, 16):
            want = reference.encode(TEXTS, prompt_name=name, truncate_dim=dimensions, normalize_embeddings=True)
            result = client.embeddings.create(model="gemma", input=TEXTS, extra_body=option,
                                              **({"dimensions": dimensions} if dimensions else {}))
            got = np.array([row.embedding for row in result.data])
            assert got.shape == want.shape
            least = min(least, min_cosine(got, want))
            got = post(server, "", {"input": TEXTS, **option, **({"dimensions": dimensions} if dimensions else {})})
            least = min(least, min_cosine(got, want))
        got = post(server, "embed", {"inputs": TEXTS, **option})  # TEI's route
        least = min(least, min_cosine(got, reference.encode(TEXTS, prompt_name=name, normalize_embeddings=True)))
    # TEXTS[3] is over the max length: cut on the left as sentence-transformers cuts it (<bos> and <eos> kept).
    reference.tokenizer.truncation_side = "left"
    try:
        want = reference.encode([TEXTS[3]], normalize_embeddings=True)
    finally:
        reference.tokenizer.truncation_side = "right"
    least = min(least, min_cosine(post(server, "embed", {"inputs": [TEXTS[3]], "truncation_direction": "left"}), want))
    print(f"embeddinggemma ({info['engine']}): 1 - least cosine to sentence-transformers {1 - least:.1e}")
    assert least >= MIN_COSINE


def test_jina_v3_s_original_layout_is_refused_by_the_build(gemma, tmp_path):
    source = tmp_path / "jina-embeddings-v3"
    shutil.copytree(gemma, source)
    config = {**json.loads((source / "config.json").read_text()), **JINA_V3_CONFIG}
    (source / "config.json").write_text(json.dumps(config))
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        code = build_main(["--model", str(source), "--name", "jina", "--config", str(make_server_config(tmp_path)),
                           "--export-path", str(tmp_path / "model_store")])
    assert code == 1
    assert "build_mar: error: config.json: auto_map AutoModel is 'jinaai/xlm-roberta-flash-implementation--" \
           "modeling_lora.XLMRobertaLoRA'" in log.getvalue()
    assert "native JinaEmbeddingsV3Model ports its encoder" in log.getvalue()
    assert not list((tmp_path / "model_store").glob("*.mar"))
