"""The model families users deploy, in-process against sentence-transformers: plain inputs, every
prompt, inputs over the max length cut on either side, Matryoshka dimensions, token-id inputs,
token counts, position limits, and the pipeline variants (prompt excluded from pooling, Dense
with a residual, the oldest module names). The same families through the real TorchServe are in
tests/integration/test_model_families_served.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from embedserve.handler.model.inputs import ModelInput
from embedserve.handler.api.exchange import RawRequest
from tests.support.engines import make_engine
from tests.support.model_families import FAMILIES, MIN_COSINE, TEXTS, min_cosine, st_on_ids
from tests.support.parts import torch_model


@pytest.fixture(scope="module")
def engines(families):
    return {family: make_engine(path) for family, path in families.items()}


def served(engine, body) -> tuple[np.ndarray, dict]:
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", "")])
    assert response.status == 200, response.body
    answer = json.loads(response.body)
    return np.array([row["embedding"] for row in answer["data"]]), answer


@pytest.mark.parametrize("family", FAMILIES)
def test_every_prompt_matches_sentence_transformers(family, engines, references):
    engine, reference = engines[family], references[family]
    for name in [None, *engine.text.prompts]:
        want = reference.encode(TEXTS, prompt_name=name)
        got, answer = served(engine, {"input": TEXTS, **({"prompt_name": name} if name else {})})
        assert got.shape == want.shape
        assert min_cosine(got, want) >= MIN_COSINE, (family, name)
        # usage counts what the model saw: sentence-transformers' own tokenization, prompt included.
        features = reference.tokenize([engine.text.prompts.get(name, "") + text for text in TEXTS])
        assert answer["usage"]["prompt_tokens"] == int(features["attention_mask"].sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_matryoshka_dimensions_match_truncate_dim(family, engines, references):
    engine, reference = engines[family], references[family]
    want = reference.encode(TEXTS, truncate_dim=16, normalize_embeddings=True)
    got, _ = served(engine, {"input": TEXTS, "dimensions": 16})
    assert got.shape == (len(TEXTS), 16) and min_cosine(got, want) >= MIN_COSINE


@pytest.mark.parametrize("family", FAMILIES)
def test_left_truncation_keeps_the_end_and_the_prompt(family, engines, references):
    engine, reference = engines[family], references[family]
    long_text = TEXTS[3]
    # Without a prompt: sentence-transformers with a left-truncating tokenizer.
    reference.tokenizer.truncation_side = "left"
    try:
        want = reference.encode([long_text])
    finally:
        reference.tokenizer.truncation_side = "right"
    got, answer = served(engine, {"input": [long_text], "truncation_direction": "left"})
    assert answer["usage"]["prompt_tokens"] == engine.text.max_length and min_cosine(got, want) >= MIN_COSINE

    # With a prompt, the prompt survives and the text's end is kept: the pipeline on those ids.
    for name, prompt in engine.text.prompts.items():
        if not prompt:
            continue
        tokenizer = engine.text.tokenizer
        joined = tokenizer.body_ids([prompt + long_text])[0]
        keep = len(tokenizer.body_ids([prompt])[0])
        room = engine.text.max_length - len(tokenizer.prefix) - len(tokenizer.suffix)
        ids = tokenizer.prefix + joined[:keep] + joined[len(joined) - (room - keep):] + tokenizer.suffix
        got, answer = served(engine, {"input": [long_text], "prompt_name": name, "truncation_direction": "left"})
        assert len(ids) == answer["usage"]["prompt_tokens"] == engine.text.max_length
        assert min_cosine(got, st_on_ids(reference, [ids])) >= MIN_COSINE, (family, name)


@pytest.mark.parametrize("family", ["xlmr", "qwen3", "bert_dense"])
def test_token_id_inputs_give_the_text_s_vector_with_and_without_a_prompt(family, engines, families):
    engine = engines[family]
    hf_tokenizer = AutoTokenizer.from_pretrained(families[family])
    texts = ["hello world", "the cat sat on the mat"]
    ids = [hf_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    for name in [None, *engine.text.prompts]:
        option = {"prompt_name": name} if name else {}
        from_text, text_answer = served(engine, {"input": texts, **option})
        from_ids, ids_answer = served(engine, {"input": ids, **option})
        np.testing.assert_allclose(from_ids, from_text, atol=1e-6)
        assert ids_answer["usage"] == text_answer["usage"]


@pytest.mark.parametrize("family", ["xlmr", "mpnet"])
def test_position_limit_is_the_usable_one(family, families, engines):
    """66 position embeddings, 64 usable (positions start after the padding id): the server stops
    at 64, and 64 is exactly where transformers itself stops working."""
    engine = engines[family]
    assert engine.encoder.max_positions == 64 and engine.text.max_length <= 64
    with pytest.raises(ValueError, match="65 exceeds the 64 positions"):
        make_engine(families[family], max_length=65)
    longest = make_engine(families[family], max_length=64)
    got, answer = served(longest, {"input": [TEXTS[3]]})
    assert answer["usage"]["prompt_tokens"] == 64 and np.isfinite(got).all()
    model = AutoModel.from_pretrained(families[family]).eval()
    with torch.no_grad():
        model(input_ids=torch.full((1, 64), 5))
        with pytest.raises((IndexError, RuntimeError), match="out of"):  # past the table's rows
            model(input_ids=torch.full((1, 65), 5))


def variant(families, tmp_path, edit) -> tuple:
    """A copy of the BERT family with its pipeline edited, its engine and sentence-transformers."""
    import shutil

    from sentence_transformers import SentenceTransformer

    path = tmp_path / "variant"
    shutil.copytree(families["bert_dense"], path)
    edit(path)
    return path, make_engine(path), SentenceTransformer(str(path), device="cpu")


def test_prompt_excluded_from_pooling_matches_sentence_transformers(families, tmp_path):
    def edit(path):
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"embedding_dimension": 32, "pooling_mode": ["mean", "cls"], "include_prompt": False}))
        (path / "2_Dense" / "config.json").write_text(json.dumps(
            {"in_features": 64, "out_features": 24, "activation_function": "torch.nn.modules.activation.Tanh"}))
        from safetensors.torch import save_file
        save_file({"linear.weight": torch.randn(24, 64), "linear.bias": torch.randn(24)},
                  str(path / "2_Dense" / "model.safetensors"))
        (path / "config_sentence_transformers.json").write_text(json.dumps(
            {"prompts": {"query": "Represent this query for retrieval: "}, "default_prompt_name": None}))

    _, engine, reference = variant(families, tmp_path, edit)
    want = reference.encode(TEXTS, prompt_name="query")
    got, _ = served(engine, {"input": TEXTS, "prompt_name": "query"})
    assert min_cosine(got, want) >= MIN_COSINE
    # The prompt changes the attention but not what is pooled: still not the prompt-less vector.
    assert min_cosine(got, served(engine, {"input": TEXTS})[0]) < 0.9999


def test_dense_with_residual_relu_and_legacy_module_names(families, tmp_path):
    def edit(path):
        from safetensors.torch import save_file
        (path / "2_Dense" / "config.json").write_text(json.dumps(
            {"in_features": 32, "out_features": 24, "bias": False, "use_residual": True,
             "activation_function": "torch.nn.modules.activation.ReLU"}))
        save_file({"linear.weight": torch.randn(24, 32), "residual.weight": torch.randn(24, 32)},
                  str(path / "2_Dense" / "model.safetensors"))
        modules = json.loads((path / "modules.json").read_text())
        for module in modules:  # the names sentence-transformers 2 and 3 wrote
            module["type"] = "sentence_transformers.models." + module["type"].rsplit(".", 1)[-1]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))

    _, engine, reference = variant(families, tmp_path, edit)
    assert engine.info()["modules"] == ["Transformer", "Pooling(cls)", "Dense(32->24, ReLU, residual)", "Normalize"]
    texts = TEXTS + ["HELLO World", "Hello WORLD"]
    want = reference.encode(texts)
    got, _ = served(engine, {"input": texts})
    assert min_cosine(got, want) >= MIN_COSINE
    np.testing.assert_allclose(got[-1], got[-2], atol=1e-6)  # do_lower_case: the same text once lowercased


def test_head_weights_that_do_not_fit_are_refused(families, tmp_path):
    from embedserve.handler.model.description import ModelFilesError

    def edit(path):
        from safetensors.torch import save_file
        save_file({"linear.weight": torch.randn(24, 32)}, str(path / "2_Dense" / "model.safetensors"))

    with pytest.raises(ModelFilesError, match="linear.bias"):
        variant(families, tmp_path, edit)


def test_info_reports_the_pipeline(engines):
    info = engines["bert_dense"].info()
    assert info["architecture"] == "bert" and info["pooling"] == "cls" and info["embedding_dimension"] == 24
    assert info["modules"] == ["Transformer", "Pooling(cls)", "Dense(32->24, Tanh)", "Normalize"]
    assert engines["qwen3"].info()["pooling"] == "last_token"


def test_cache_keys_tell_excluded_prompt_tokens_apart(tiny_model_dir):
    from embedserve.handler.scheduling.cache import EmbeddingCache

    cache = EmbeddingCache("m", None, None)
    assert cache.key(ModelInput([1, 2, 3])) == cache.key(ModelInput([1, 2, 3], 0)) != cache.key(ModelInput([1, 2, 3], 2))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pass_builds_no_key_value_cache(family, engines):
    # Decoders (Qwen3) cache every layer's keys and values by default: memory held to the end of
    # the pass for nothing, since an embedding pass never decodes further.
    model = torch_model(engines[family].encoder)
    ids = torch.randint(5, 60, (2, 9))
    with torch.inference_mode():
        output = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert getattr(output, "past_key_values", None) is None and getattr(output, "cache", None) is None
    assert model.config.use_cache is False
