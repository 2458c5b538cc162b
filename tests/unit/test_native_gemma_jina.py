"""EmbeddingGemma (a Gemma3 decoder run with bidirectional attention) served in process exactly as
sentence-transformers runs it: every prompt, Matryoshka dimensions, inputs longer than its
sliding window and than its max length, a bidirectional mask (never a causal one); its ONNX export
is used only where exact. jina-embeddings-v3's original layout refused with what transformers'
native port lacks. The same through the real TorchServe: tests/integration/test_native_gemma_jina_served.py."""

from __future__ import annotations

import inspect
import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, JinaEmbeddingsV3Config, JinaEmbeddingsV3Model

from embedserve.archive.native import NATIVE_FIELD, NativeLayoutError
from embedserve.archive.onnx_export import export_onnx
from embedserve.archive.stage import stage_model
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.backends.onnx_runtime import ONNX_FILE, OnnxTransformer
from tests.support.engines import make_engine
from tests.support.model_families import TEXTS, min_cosine
from tests.support.native_models import GEMMA_PROMPTS, JINA_V3_CONFIG, JINA_V3_TASKS, make_embeddinggemma

MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(the sentence-transformers folder, its staged copy)."""
    root = tmp_path_factory.mktemp("gemma")
    source = make_embeddinggemma(root / "embeddinggemma")
    stage_model(source, root / "staged")
    return source, root / "staged"


@pytest.fixture(scope="module")
def engine(gemma):
    return make_engine(gemma[1], dtype="float32")


@pytest.fixture(scope="module")
def reference(gemma):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gemma[0]), device="cpu")


def served(engine, body) -> np.ndarray:
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", "")])
    assert response.status == 200, response.body
    return np.array([row["embedding"] for row in json.loads(response.body)["data"]])


def test_the_test_model_is_embeddinggemma_s_shape(gemma, reference):
    source, staged = gemma
    config = json.loads((staged / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["use_bidirectional_attention"] is True
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"} and NATIVE_FIELD not in config
    assert [type(m).__name__ for m in reference] == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    assert reference.prompts == GEMMA_PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer("hello world")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"  # the reference pads on the left, the engine on the right
    # Inputs longer than the bidirectional sliding window (|i - j| < 16 // 2 + 1), so that it matters.
    assert max(len(tokenizer(text)["input_ids"]) for text in TEXTS) > 2 * 9


def test_served_vectors_are_sentence_transformers(engine, reference):
    info = engine.info()
    assert info["model_class"] == "Gemma3TextModel" and info["pooling"] == "mean"
    assert info["modules"] == ["Transformer", "Pooling(mean)", "Dense(32->128, Identity)",
                               "Dense(128->32, Identity)", "Normalize"]
    assert info["prompts"] == GEMMA_PROMPTS
    least = 1.0
    for name in [None, *GEMMA_PROMPTS]:
        want = reference.encode(TEXTS, prompt_name=name, normalize_embeddings=True)
        got = served(engine, {"input": TEXTS, **({"prompt_name": name} if name else {})})
        assert got.shape == want.shape
        least = min(least, min_cosine(got, want))
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    for dimensions in (8, 16):
        want = reference.encode(TEXTS, truncate_dim=dimensions, normalize_embeddings=True, prompt_name="query")
        got = served(engine, {"input": TEXTS, "dimensions": dimensions, "prompt_name": "query"})
        assert got.shape == (len(TEXTS), dimensions)
        least = min(least, min_cosine(got, want))
    print(f"embeddinggemma ({info['engine']}): least cosine to sentence-transformers {least:.10f} "
          f"(1 - cosine {1 - least:.1e})")
    assert least >= MIN_COSINE


def test_a_request_s_vector_does_not_depend_on_its_batch(engine):
    """Padding in a batch is masked out: each text alone gives the vector it gets among others."""
    together = served(engine, {"input": TEXTS, "prompt_name": "document"})
    alone = np.stack([served(engine, {"input": [text], "prompt_name": "document"})[0] for text in TEXTS])
    assert min_cosine(alone, together) >= MIN_COSINE


def test_a_causal_mask_would_give_other_vectors(gemma, engine, reference):
    """The same weights run causally differ clearly: the bar above tells a bidirectional mask from a causal one."""
    from sentence_transformers import SentenceTransformer

    causal = SentenceTransformer(str(gemma[0]), device="cpu",
                                 config_kwargs={"use_bidirectional_attention": False})
    assert causal[0].model.config.use_bidirectional_attention is False
    got = served(engine, {"input": TEXTS})
    assert min_cosine(got, causal.encode(TEXTS, normalize_embeddings=True)) < 0.99


def test_the_onnx_export_is_used_only_where_exact(gemma, tmp_path):
    """The build's export of a bidirectional Gemma3: either it fails and torch serves the model, or
    its states are the model's on a padded batch longer than the sliding window."""
    model_dir = tmp_path / "model"
    shutil.copytree(gemma[1], model_dir)
    outcome = export_onnx(model_dir, 256)
    print(f"embeddinggemma ONNX export: {outcome}")
    if not outcome.startswith("exported"):
        assert outcome.endswith("served by torch") and not (model_dir / ONNX_FILE).exists()
        return
    ids = torch.randint(5, 250, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(40) < torch.tensor([40, 23, 3])[:, None]).long()
    with torch.no_grad():
        want = AutoModel.from_pretrained(model_dir).eval()(input_ids=ids, attention_mask=mask).last_hidden_state
    got = OnnxTransformer(model_dir / ONNX_FILE, threads=1)(ids, mask)
    assert float((got - want)[mask.bool()].abs().max()) < 1e-4


# --- jina-embeddings-v3 -------------------------------------------------------------------------

def test_transformers_native_jina_v3_port_has_no_task_adapters():
    """Why jina-embeddings-v3 is refused: the native class has no LoRA weights and no argument that
    selects an adapter. Should a later transformers add them, this fails, and the refusal is to be revisited."""
    config = JinaEmbeddingsV3Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32)
    with torch.device("meta"):
        names = list(JinaEmbeddingsV3Model(config).state_dict())
    assert not [name for name in names if "lora" in name.lower() or "adapt" in name.lower()]
    parameters = inspect.signature(JinaEmbeddingsV3Model.forward).parameters
    assert not [name for name in parameters if "adapt" in name or "task" in name or "lora" in name]


def test_jina_v3_s_original_layout_is_refused_with_what_the_native_port_lacks(gemma, tmp_path):
    source = tmp_path / "jina-embeddings-v3"
    shutil.copytree(gemma[0], source)
    config = {**json.loads((source / "config.json").read_text()), **JINA_V3_CONFIG}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(NativeLayoutError) as refused:
        stage_model(source, tmp_path / "staged")
    message = str(refused.value)
    assert f"auto_map AutoModel is '{JINA_V3_CONFIG['auto_map']['AutoModel']}'" in message
    assert "JinaEmbeddingsV3Model" in message and "LoRA task adapters" in message
    assert all(task in message for task in JINA_V3_TASKS)
