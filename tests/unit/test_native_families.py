"""Original remote-code layouts (nomic-bert, GTE "new", Arctic-embed-m-v2.0) staged for transformers'
native classes (embedserve/archive/native.py) and served in process, against sentence-transformers
on the native model: every prompt, Matryoshka dimensions, normalized; the staged config; the
refusals (a missing or unexpected weight, code with no native port, a setting the native class
cannot compute). The same through the real TorchServe: tests/integration/test_native_served.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, GteConfig, GteModel

from embedserve.archive.native import NATIVE_FIELD, NativeLayoutError, native_note
from embedserve.archive.stage import stage_model
from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.model.description import ModelFilesError
from embedserve.handler.model.files import describe_model
from tests.support.engines import make_engine
from tests.support.model_families import TEXTS, min_cosine
from tests.support.native_models import (GTE_ROPE, HEADS, HIDDEN, NATIVE_FAMILIES, make_native_and_original,
                                         original_ntk_inv_freq)

MIN_COSINE = 0.99999
CLASSES = {"nomic": "NomicBertModel", "gte": "GteModel", "arctic": "GteModel"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (native folder, original folder, staged folder)."""
    root = tmp_path_factory.mktemp("native")
    made = {}
    for family in NATIVE_FAMILIES:
        native, original = make_native_and_original(family, root)
        stage_model(original, root / f"{family}-staged")
        made[family] = (native, original, root / f"{family}-staged")
    return made


@pytest.fixture(scope="module")
def engines(folders):
    return {family: make_engine(staged, dtype="float32") for family, (_, _, staged) in folders.items()}


@pytest.fixture(scope="module")
def references(folders):
    from sentence_transformers import SentenceTransformer

    return {family: SentenceTransformer(str(native), device="cpu") for family, (native, _, _) in folders.items()}


def served(engine, body) -> np.ndarray:
    [response] = engine.handle([RawRequest(json.dumps(body).encode(), "application/json", "")])
    assert response.status == 200, response.body
    return np.array([row["embedding"] for row in json.loads(response.body)["data"]])


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_the_test_s_original_layout_is_what_transformers_converts(folders, family, tmp_path):
    """The original-layout weights, loaded by transformers' own conversion_mapping.py under the
    native config, give the native model's states: the fixture writes them as the originals are."""
    native, original, _ = folders[family]
    shutil.copyfile(native / "config.json", tmp_path / "config.json")
    shutil.copyfile(original / "model.safetensors", tmp_path / "model.safetensors")
    ids = torch.randint(5, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        converted = AutoModel.from_pretrained(tmp_path).eval()(input_ids=ids).last_hidden_state
        reference = AutoModel.from_pretrained(native).eval()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(converted, reference, rtol=0, atol=0)


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_the_staged_folder_is_the_native_layout(folders, family):
    native, original, staged = folders[family]
    config = json.loads((staged / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] == [CLASSES[family]]
    assert config[NATIVE_FIELD] == {"class": CLASSES[family],
                                    "converted_from": json.loads((original / "config.json").read_text())["auto_map"][
                                        "AutoModel"]}
    assert sorted(p.name for p in staged.glob("*.safetensors")) == ["model.safetensors"]
    want = load_file(str(native / "model.safetensors"))
    got = load_file(str(staged / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want)
    description = describe_model(staged)
    assert description.model_type == ("nomic_bert" if family == "nomic" else "gte")
    assert description.usable_positions == 512  # nomic: its n_positions; GTE: max_position_embeddings


@pytest.mark.parametrize("family", ["gte", "arctic"])
def test_gte_ntk_scaling_becomes_the_original_s_frequencies(folders, family):
    """The original's fixed NTK scaling, mapped onto a native linear rope, gives its very frequencies."""
    staged = folders[family][2]
    config = GteConfig.from_pretrained(staged)
    theta, factor = GTE_ROPE[family]
    want = original_ntk_inv_freq(theta, factor, HIDDEN // HEADS)
    torch.testing.assert_close(GteModel(config).rotary_emb.inv_freq, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_served_vectors_are_sentence_transformers_on_the_native_model(family, engines, references):
    engine, reference = engines[family], references[family]
    names = [None, *engine.text.prompts]
    if family == "nomic":
        assert engine.text.prompts == {"query": "search_query: ", "document": "search_document: "}
    least = 1.0
    for name in names:
        want = reference.encode(TEXTS, prompt_name=name, normalize_embeddings=True)
        got = served(engine, {"input": TEXTS, **({"prompt_name": name} if name else {})})
        assert got.shape == want.shape
        least = min(least, min_cosine(got, want))
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    prompt = {"prompt_name": names[-1]} if names[-1] else {}  # Matryoshka dimensions, with a prompt where any
    for dimensions in (8, 16):
        want = reference.encode(TEXTS, truncate_dim=dimensions, normalize_embeddings=True, **prompt)
        got = served(engine, {"input": TEXTS, "dimensions": dimensions, **prompt})
        assert got.shape == (len(TEXTS), dimensions)
        least = min(least, min_cosine(got, want))
    print(f"{family}: least cosine to sentence-transformers {least:.10f} (1 - cosine {1 - least:.1e})")
    assert least >= MIN_COSINE, family


def test_info_names_the_native_class(engines):
    for family, engine in engines.items():
        info = engine.info()
        assert info["model_class"] == CLASSES[family] and info["architecture"] in ("nomic_bert", "gte")


# --- Refusals ----------------------------------------------------------------------------------

def _copy(folders, family, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(folders[family][1], source)
    return source


def _edit_weights(folder, edit):
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"))


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_a_missing_weight_is_refused_by_name(folders, tmp_path):
    source = _copy(folders, "nomic", tmp_path)
    _edit_weights(source, lambda w: w.pop("encoder.layers.1.mlp.fc12.weight"))
    with pytest.raises(NativeLayoutError, match=r"missing layers\.1\.mlp\.gate_proj\.weight; unexpected none"):
        stage_model(source, tmp_path / "staged")


def test_an_unexpected_weight_is_refused_by_name(folders, tmp_path):
    source = _copy(folders, "gte", tmp_path)
    _edit_weights(source, lambda w: w.update({"new.pooler.dense.weight": torch.zeros(HIDDEN, HIDDEN)}))
    with pytest.raises(NativeLayoutError, match=r"missing none; unexpected pooler\.dense\.weight"):
        stage_model(source, tmp_path / "staged")


def test_a_weight_of_another_shape_is_refused(folders, tmp_path):
    source = _copy(folders, "nomic", tmp_path)
    _edit_config(source, n_inner=512)  # the weights are 256 wide
    with pytest.raises(NativeLayoutError, match=r"wrong shape.*layers\.0\.mlp\.down_proj\.weight"):
        stage_model(source, tmp_path / "staged")


@pytest.mark.parametrize("model_type, auto_map", [
    ("bert", {"AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"}),
    ("new", {"AutoModel": "Alibaba-NLP/new-impl--modeling.SomethingElse"}),
    ("xlm-roberta", {"AutoModel": "jinaai/xlm-roberta-flash-implementation--modeling_lora.XLMRobertaLoRA"}),
])
def test_code_with_no_native_port_is_refused(folders, tmp_path, model_type, auto_map):
    source = _copy(folders, "gte", tmp_path)
    _edit_config(source, model_type=model_type, auto_map=auto_map)
    with pytest.raises(NativeLayoutError, match=f"auto_map AutoModel is '{auto_map['AutoModel']}', the model's own "
                                                "code, which this server never runs, and transformers has no native"):
        stage_model(source, tmp_path / "staged")


def test_the_published_head_entries_of_auto_map_are_never_run_and_do_not_stop_the_build(folders, tmp_path):
    """nomic-embed-text-v1.5 publishes AutoModelForMaskedLM beside its encoder, gte-*-v1.5 five heads:
    the build converts the encoder and keeps none of them."""
    for family, heads in (("nomic", {"AutoModelForMaskedLM"}),
                          ("gte", {f"AutoModelFor{head}" for head in ("MaskedLM", "MultipleChoice", "QuestionAnswering",
                                                                        "SequenceClassification", "TokenClassification")})):
        auto_map = json.loads((folders[family][1] / "config.json").read_text())["auto_map"]
        assert heads <= set(auto_map)
        staged = json.loads((folders[family][2] / "config.json").read_text())
        assert "auto_map" not in staged and staged[NATIVE_FIELD]["converted_from"] == auto_map["AutoModel"]


@pytest.mark.parametrize("changes, entry", [
    # The encoder entry decides, whatever the heads name.
    ({"auto_map": {"AutoModel": "Alibaba-NLP/new-impl--modeling.SomethingElse",
                   "AutoModelForMaskedLM": "Alibaba-NLP/new-impl--modeling.NewForMaskedLM"}}, "AutoModel"),
    # The class the checkpoint was saved as decides: a classifier head is what would run.
    ({"architectures": ["NewForSequenceClassification"],
      "auto_map": {"AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
                   "AutoModelForSequenceClassification": "Alibaba-NLP/new-impl--modeling.NewForSequenceClassification"}},
     "AutoModelForSequenceClassification"),
    # No encoder entry: the first head decides (nothing tells which would run).
    ({"auto_map": {"AutoModelForMaskedLM": "Alibaba-NLP/new-impl--modeling.NewForMaskedLM"}}, "AutoModelForMaskedLM"),
])
def test_the_refusal_names_the_auto_map_entry_that_decided_it(folders, tmp_path, changes, entry):
    source = _copy(folders, "gte", tmp_path)
    _edit_config(source, **changes)
    with pytest.raises(NativeLayoutError, match=f"auto_map {entry} is '{changes['auto_map'][entry]}'"):
        stage_model(source, tmp_path / "staged")


@pytest.mark.parametrize("family, changes, message", [
    ("nomic", {"rotary_emb_interleaved": True}, "rotary_emb_interleaved = True"),
    ("nomic", {"rotary_scaling_factor": 2.0}, "rotary_scaling_factor = 2.0"),
    ("nomic", {"qkv_proj_bias": True}, "qkv_proj_bias = True"),
    ("nomic", {"activation_function": "gelu"}, "activation_function = 'gelu'"),
    ("nomic", {"n_embd": None, "hidden_size": 64}, "n_embd = None|does not say"),
    ("gte", {"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}}, "only fixed NTK"),
    ("gte", {"logn_attention_scale": True}, "logn_attention_scale = True"),
    ("gte", {"layer_norm_type": "rms_norm"}, "layer_norm_type = 'rms_norm'"),
    ("arctic", {"architectures": ["GteForSequenceClassification"]}, "only the encoder"),
    # Beside the encoder, only other heads of its own code (named in auto_map) are left out.
    ("gte", {"architectures": ["NewModel", "BertForTokenClassification"]}, "only the encoder"),
])
def test_settings_the_native_class_cannot_compute_are_refused(folders, tmp_path, family, changes, message):
    source = _copy(folders, family, tmp_path)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None or key not in changes}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(NativeLayoutError, match=message):
        stage_model(source, tmp_path / "staged")


def test_an_unstaged_original_folder_is_refused_where_it_is_read(folders):
    with pytest.raises(ModelFilesError, match="never runs; ./build_mar.sh rewrites the original nomic-bert"):
        describe_model(folders["nomic"][1])


@pytest.mark.parametrize("slug", ["nomic-embed-text-v1.5", "gte-base-en-v1.5", "gte-multilingual-base"])
def test_a_published_original_folder_stages_for_sentence_transformers(slug, tmp_path):
    """The published files (tests/fixtures/published/) staged: nomic's sentence_bert_config.json
    passes `safe_serialization` to its own loader, which the native class refuses; staged without
    it, sentence-transformers loads the folder and gives the native port's vectors.
    gte-multilingual-base is saved with its token-weight head beside the encoder: staged without
    the head's weights, which the build's note names."""
    from sentence_transformers import SentenceTransformer

    from tests.support.published import make_published, reference_folder

    original = make_published(slug, tmp_path / slug)
    stage_model(original, tmp_path / "staged")
    if (original / "sentence_bert_config.json").is_file():
        published = json.loads((original / "sentence_bert_config.json").read_text())
        staged = json.loads((tmp_path / "staged" / "sentence_bert_config.json").read_text())
        assert staged == {**published, **({"model_args": {}} if "model_args" in published else {})}
    heads = ["classifier.bias", "classifier.weight"] if slug == "gte-multilingual-base" else []
    assert json.loads((tmp_path / "staged" / "config.json").read_text())[NATIVE_FIELD].get("heads_dropped", []) == heads
    assert ("were left out" in native_note(tmp_path / "staged")) == bool(heads)
    got = SentenceTransformer(str(tmp_path / "staged"), device="cpu").encode(TEXTS)
    want = SentenceTransformer(str(reference_folder(original)), device="cpu").encode(TEXTS)
    assert min_cosine(got, want) >= MIN_COSINE
