import json

import pytest

from handler.model_files import ModelFilesError, describe_model
from tests.tiny_model import make_tiny_model


@pytest.mark.parametrize("pooling", ["mean", "cls", "last_token"])
def test_pooling_and_max_length_come_from_sentence_transformers_files(tmp_path, pooling):
    model = make_tiny_model(tmp_path / "m", pooling=pooling, max_seq_length=40)
    description = describe_model(model)
    assert description.pooling == pooling
    assert description.max_seq_length == 40


def test_plain_transformers_folder_says_nothing(tmp_path):
    model = make_tiny_model(tmp_path / "m", sentence_transformers_files=False)
    description = describe_model(model)
    assert description.pooling is None and description.max_seq_length is None


def test_newer_pooling_mode_field(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    assert describe_model(model).pooling == "last_token"


def test_several_pooling_modes_are_refused(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    (model / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}))
    with pytest.raises(ModelFilesError, match="exactly one"):
        describe_model(model)


def test_missing_pooling_config_is_reported(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    (model / "1_Pooling" / "config.json").unlink()
    with pytest.raises(ModelFilesError, match="1_Pooling"):
        describe_model(model)


def test_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelFilesError, match="config.json"):
        describe_model(tmp_path)
