"""EuroBERT (transformers' native EuroBertModel: Llama layers with bidirectional attention) served in
process exactly as sentence-transformers runs it, by torch and by the build's ONNX export: every
prompt, Matryoshka dimensions, inputs longer than the max length cut on either side, a batch padded
with the same id as the end-of-text token each input ends with, and a bidirectional mask (never a
causal one). Its Hub folder, which names EuroBERT's own code in `auto_map`, is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaModel

from embedserve.archive.native import NATIVE_FIELD, NativeLayoutError
from embedserve.archive.onnx_export import export_onnx
from embedserve.archive.stage import stage_model
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.backends.onnx_runtime import ONNX_FILE
from embedserve.handler.model.files import usable_positions
from tests.support.engines import make_engine
from tests.support.model_families import TEXTS, min_cosine, st_on_ids
from tests.support.native_models import EUROBERT_PROMPTS, make_eurobert

MIN_COSINE = 0.99999
# EuroBERT-210m's config.json on the Hub: its own code, which the server never runs.
HUB_AUTO_MAP = {"AutoConfig": "configuration_eurobert.EuroBertConfig",
                "AutoModel": "modeling_eurobert.EuroBertModel",
                "AutoModelForMaskedLM": "modeling_eurobert.EuroBertForMaskedLM"}


@pytest.fixture(scope="module")
def eurobert(tmp_path_factory):
    """(the sentence-transformers folder, its staged copy with the build's ONNX export, the export's outcome)."""
    root = tmp_path_factory.mktemp("eurobert")
    source = make_eurobert(root / "eurobert")
    staged = root / "staged"
    stage_model(source, staged)
    config = json.loads((staged / "config.json").read_text())
    return source, staged, export_onnx(staged, usable_positions(config))


@pytest.fixture(scope="module")
def reference(eurobert):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(eurobert[0]), device="cpu")


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def engine(request, eurobert):
    return make_engine(eurobert[1], dtype="float32", engine=request.param)


def served(engine, body) -> np.ndarray:
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", "")])
    assert response.status == 200, response.body
    return np.array([row["embedding"] for row in json.loads(response.body)["data"]])


def test_the_test_model_is_eurobert_s_shape(eurobert, reference):
    source, staged, _ = eurobert
    config = json.loads((staged / "config.json").read_text())
    assert config["model_type"] == "eurobert" and config["architectures"] == ["EuroBertModel"]
    assert "auto_map" not in config and NATIVE_FIELD not in config
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped keys, as EuroBERT-610m's
    assert [type(m).__name__ for m in reference] == ["Transformer", "Pooling", "Normalize"]
    assert reference.prompts == EUROBERT_PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer("hello world")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id == tokenizer.pad_token_id
    assert tokenizer.padding_side == "right"
    assert max(len(tokenizer(text)["input_ids"]) for text in TEXTS) > reference.max_seq_length


def test_the_build_exports_eurobert_to_onnx(eurobert):
    outcome = eurobert[2]
    print(f"eurobert ONNX export: {outcome}")
    assert outcome.startswith("exported") and (eurobert[1] / ONNX_FILE).is_file()


def test_served_vectors_are_sentence_transformers(engine, reference):
    info = engine.info()
    assert info["model_class"] == "EuroBertModel" and info["pooling"] == "mean"
    assert info["modules"] == ["Transformer", "Pooling(mean)", "Normalize"] and info["prompts"] == EUROBERT_PROMPTS
    least = 1.0
    for name in [None, *EUROBERT_PROMPTS]:
        want = reference.encode(TEXTS, prompt_name=name, normalize_embeddings=True)
        got = served(engine, {"input": TEXTS, **({"prompt_name": name} if name else {})})
        assert got.shape == want.shape
        least = min(least, min_cosine(got, want))
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    want = reference.encode(TEXTS, truncate_dim=16, normalize_embeddings=True, prompt_name="query")
    got = served(engine, {"input": TEXTS, "dimensions": 16, "prompt_name": "query"})
    assert got.shape == (len(TEXTS), 16)
    least = min(least, min_cosine(got, want))
    print(f"eurobert ({info['engine']}): least cosine to sentence-transformers {least:.10f} "
          f"(1 - cosine {1 - least:.1e})")
    assert least >= MIN_COSINE


def test_left_truncation_keeps_the_end_and_the_prompt(engine, reference):
    long_text = TEXTS[3]
    reference.tokenizer.truncation_side = "left"
    try:
        want = reference.encode([long_text], normalize_embeddings=True)
    finally:
        reference.tokenizer.truncation_side = "right"
    got = served(engine, {"input": [long_text], "truncation_direction": "left"})
    assert min_cosine(got, want) >= MIN_COSINE
    # With a prompt: <|begin_of_text|>, the prompt, the text's end, <|end_of_text|>, through the pipeline.
    tokenizer = engine.text.tokenizer
    prompt = EUROBERT_PROMPTS["query"]
    joined = tokenizer.body_ids([prompt + long_text])[0]
    keep = len(tokenizer.body_ids([prompt])[0])
    room = engine.text.max_length - len(tokenizer.prefix) - len(tokenizer.suffix)
    ids = tokenizer.prefix + joined[:keep] + joined[len(joined) - (room - keep):] + tokenizer.suffix
    assert len(ids) == engine.text.max_length
    got = served(engine, {"input": [long_text], "prompt_name": "query", "truncation_direction": "left"})
    assert min_cosine(got, st_on_ids(reference, [ids])) >= MIN_COSINE


def test_a_request_s_vector_does_not_depend_on_its_batch(engine):
    """The padding id is the end-of-text id every input ends with: padding is told by the mask, not the id."""
    together = served(engine, {"input": TEXTS, "prompt_name": "document"})
    alone = np.stack([served(engine, {"input": [text], "prompt_name": "document"})[0] for text in TEXTS])
    assert min_cosine(alone, together) >= MIN_COSINE


def test_a_causal_mask_would_give_other_vectors(eurobert, reference):
    """The same weights run causally (as LlamaModel) differ clearly: the bar above tells the
    bidirectional mask from a causal one."""
    causal, loading = LlamaModel.from_pretrained(eurobert[1], output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    tokenizer = reference.tokenizer
    with torch.no_grad():
        rows = [causal(**tokenizer(text, truncation=True, max_length=reference.max_seq_length,
                                   return_tensors="pt")).last_hidden_state[0].mean(0) for text in TEXTS]
    want = reference.encode(TEXTS, normalize_embeddings=True)
    assert min_cosine(torch.stack(rows).numpy(), want) < 0.99


def test_eurobert_s_hub_folder_naming_its_own_code_is_refused(eurobert, tmp_path):
    source = tmp_path / "eurobert-hub"
    shutil.copytree(eurobert[0], source)
    config = {**json.loads((source / "config.json").read_text()), "auto_map": HUB_AUTO_MAP}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(NativeLayoutError, match="auto_map AutoModel is 'modeling_eurobert.EuroBertModel'"):
        stage_model(source, tmp_path / "staged")
