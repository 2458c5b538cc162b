"""The suite's archive cache (tests/support/archives.py): what is part of a build's key, and the
TorchServe settings a reused archive is given."""

import json
import zipfile

import yaml

from embedserve.archive.build import REGISTRATION
from tests.support.archives import archive_key, split_registration, with_settings


def test_registration_flags_are_set_apart_from_the_build_s():
    args = ["--model", "m", "--workers", "1", "--batch-size=4", "--name", "tiny", "--max-batch-delay", "20",
            "--set", "packed=true", "--response-timeout", "9", "--startup-timeout", "30"]
    archive_args, settings = split_registration(args)
    assert archive_args == ["--model", "m", "--name", "tiny", "--set", "packed=true"]
    assert settings == {"minWorkers": 1, "maxWorkers": 1, "batchSize": 4, "maxBatchDelay": 20,
                        "responseTimeout": 9, "startupTimeout": 30}
    assert set(settings) == set(REGISTRATION)


def test_a_folder_is_keyed_by_its_name_and_contents_not_its_path(tmp_path):
    def folder(parent, text):
        path = tmp_path / parent / "model"
        path.mkdir(parents=True)
        (path / "config.json").write_text(text)
        return str(path)

    one, same, other = folder("a", "{}"), folder("b", "{}"), folder("c", '{"x": 1}')
    assert archive_key(["--model", one, "--name", "m"]) == archive_key(["--model", same, "--name", "m"])
    assert archive_key(["--model", one, "--name", "m"]) != archive_key(["--model", other, "--name", "m"])
    assert archive_key(["--model", one, "--name", "m"]) != archive_key(["--model", one, "--name", "n"])
    renamed = tmp_path / "a" / "renamed"
    (tmp_path / "a" / "model").rename(renamed)  # the folder's name is the served model_id
    assert archive_key(["--model", str(renamed), "--name", "m"]) != archive_key(["--model", same, "--name", "m"])
    assert archive_key(["--name", "minilm"]) == ("--name", "minilm")  # the default model: no folder


def test_a_reused_archive_says_the_settings_asked_for_and_keeps_the_rest(tmp_path):
    built = {"minWorkers": 2, "maxWorkers": 2, "batchSize": 32, "maxBatchDelay": 5, "responseTimeout": 120,
             "startupTimeout": 300, "handler": {"dtype": "float32"}}
    source = tmp_path / "tiny.mar"
    with zipfile.ZipFile(source, "w") as mar:
        mar.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"configFile": "model-config.yaml"}}))
        mar.writestr("model-config.yaml", yaml.safe_dump(built, sort_keys=False))
        mar.writestr("model/weights.safetensors", b"\0" * 64)
    asked = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 4}
    with_settings(source, tmp_path / "copy.mar", {**{key: built[key] for key in REGISTRATION}, **asked})
    with zipfile.ZipFile(tmp_path / "copy.mar") as copy:
        assert yaml.safe_load(copy.read("model-config.yaml")) == {**built, **asked}
        assert copy.read("model/weights.safetensors") == b"\0" * 64
        assert copy.namelist() == ["MAR-INF/MANIFEST.json", "model-config.yaml", "model/weights.safetensors"]
