"""Reading a model folder: its sentence-transformers pipeline, prompts, limits, and what is refused."""

import json

import pytest

from embedserve.handler.model.description import ModelFilesError, Pooling
from embedserve.handler.model.files import describe_model, usable_positions
from tests.support.tiny_model import make_tiny_model


def write_modules(model, *extra):
    """The tiny model's modules.json with `extra` (type, folder, config) modules after its Pooling."""
    modules = json.loads((model / "modules.json").read_text())
    for kind, folder, config in extra:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": folder, "type": kind})
        if folder:
            (model / folder).mkdir(exist_ok=True)
            (model / folder / "config.json").write_text(json.dumps(config))
    (model / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize("pooling", ["mean", "cls", "last_token"])
def test_pooling_and_max_length_come_from_sentence_transformers_files(tmp_path, pooling):
    model = make_tiny_model(tmp_path / "m", pooling=pooling, max_seq_length=40)
    description = describe_model(model)
    assert description.pooling == Pooling((pooling,))
    assert description.max_seq_length == 40 and description.model_type == "bert"
    assert description.modules == ["Transformer", f"Pooling({pooling})"] and description.head == ()


def test_plain_transformers_folder_says_nothing(tmp_path):
    model = make_tiny_model(tmp_path / "m", sentence_transformers_files=False)
    description = describe_model(model)
    assert description.pooling is None and description.max_seq_length is None


@pytest.mark.parametrize("config, modes", [
    ({"pooling_mode": "lasttoken"}, ("last_token",)),
    ({"pooling_mode": ["mean", "cls"]}, ("mean", "cls")),  # the order given is the order concatenated
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, ("cls", "mean")),  # legacy fixed order
    ({"pooling_mode_mean_tokens": False}, ("mean",)),  # no mode at all: sentence-transformers' default
    ({"pooling_mode_weightedmean_tokens": True, "pooling_mode_max_tokens": True}, ("max", "weightedmean")),
])
def test_pooling_modes_as_sentence_transformers_reads_them(tmp_path, config, modes):
    model = make_tiny_model(tmp_path / "m")
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **config}))
    assert describe_model(model).pooling.modes == modes


def test_include_prompt_false_is_read(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean", "include_prompt": False}))
    description = describe_model(model)
    assert description.pooling == Pooling(("mean",), include_prompt=False)
    assert "prompt excluded" in description.modules[1]


def test_head_modules_and_lowercasing_are_read_in_order(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    write_modules(model,
                  ("sentence_transformers.models.Dense", "2_Dense",
                   {"in_features": 32, "out_features": 16, "bias": True,
                    "activation_function": "torch.nn.modules.activation.Tanh"}),
                  ("sentence_transformers.models.Dropout", "3_Dropout", {"dropout": 0.1}),
                  ("sentence_transformers.sentence_transformer.modules.layer_norm.LayerNorm", "4_LayerNorm",
                   {"dimension": 16}),
                  ("sentence_transformers.base.modules.normalize.Normalize", "5_Normalize", {}))
    (model / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": True}))
    description = describe_model(model)
    assert [m.kind for m in description.head] == ["Dense", "LayerNorm", "Normalize"]
    assert description.modules == ["Transformer", "Pooling(mean)", "Dense(32->16, Tanh)", "LayerNorm(16)", "Normalize"]
    assert description.do_lower_case


@pytest.mark.parametrize("extra, message", [
    (("sentence_transformers.models.WeightedLayerPooling", "2_W", {}), "WeightedLayerPooling.*not supported"),
    (("sentence_transformers.models.CNN", "2_CNN", {}), "CNN.*not supported"),
    (("my_package.CustomHead", "2_Custom", {}), "custom code"),
    (("sentence_transformers.models.Dense", "2_Dense",
      {"in_features": 32, "out_features": 8, "activation_function": "my_package.Swish"}), "not a torch.nn module"),
    (("sentence_transformers.models.Dense", "2_Dense", {"in_features": 32}), "out_features"),
    (("sentence_transformers.base.modules.normalize.Normalize", "2_Normalize",
      {"module_input_name": "token_embeddings"}), "is not 'sentence_embedding'"),
    (("sentence_transformers.models.Pooling", "2_Pooling", {"pooling_mode": "mean"}), "second Pooling"),
])
def test_modules_that_would_change_vectors_unseen_are_refused_by_name(tmp_path, extra, message):
    model = make_tiny_model(tmp_path / "m")
    write_modules(model, extra)
    with pytest.raises(ModelFilesError, match=message):
        describe_model(model)


def test_a_pipeline_without_pooling_is_refused(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    modules = json.loads((model / "modules.json").read_text())[:1]
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelFilesError, match="no Pooling module"):
        describe_model(model)


def test_a_transformer_in_a_subfolder_is_refused(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    modules = json.loads((model / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelFilesError, match="Transformer must be the first module"):
        describe_model(model)


def test_unknown_pooling_mode_is_refused(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "median"}))
    with pytest.raises(ModelFilesError, match="median"):
        describe_model(model)


def test_missing_pooling_config_is_reported(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    (model / "1_Pooling" / "config.json").unlink()
    with pytest.raises(ModelFilesError, match="1_Pooling"):
        describe_model(model)


def test_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelFilesError, match="config.json"):
        describe_model(tmp_path)


@pytest.mark.parametrize("config, usable", [
    ({"model_type": "bert", "max_position_embeddings": 512}, 512),
    ({"model_type": "xlm-roberta", "max_position_embeddings": 514, "pad_token_id": 1}, 512),
    ({"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1}, 512),
    ({"model_type": "mpnet", "max_position_embeddings": 514, "pad_token_id": 1}, 512),
    ({"model_type": "camembert", "max_position_embeddings": 514, "pad_token_id": 1}, 512),
    ({"model_type": "qwen3", "max_position_embeddings": 32768}, 32768),
    ({"model_type": "t5"}, None),
])
def test_usable_positions_per_architecture(config, usable):
    assert usable_positions(config) == usable


@pytest.mark.parametrize("config, message", [
    ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
    ({"model_type": "new", "auto_map": {"AutoModel": "modeling.NewModel"}}, "never runs"),
    ({"model_type": "no-such-architecture"}, "not an architecture"),
])
def test_architectures_that_cannot_be_served_are_refused(tmp_path, config, message):
    model = make_tiny_model(tmp_path / "m")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFilesError, match=message):
        describe_model(model)
