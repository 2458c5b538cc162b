"""Which server, model and key `embedserve batch` uses without flags (embedserve/batch/target.py):
the working directory's config.properties and key_file.json, the model the batch lines name or
the server's only one. Against the real TorchServe: tests/integration/test_batch_served.py."""

from __future__ import annotations

import pytest

from embedserve.batch.server import JobError
from embedserve.batch.target import DEFAULT_URLS, choose_model, default_key_file, default_url


class Listed:
    """The management API's model list, as TorchServe answers it, or its failure."""

    url = "http://127.0.0.1:8081"

    def __init__(self, models=None, error=None):
        self._models, self._error = models, error

    def models(self):
        if self._error:
            raise self._error
        return self._models


def test_the_urls_are_config_properties_addresses_as_a_client_reaches_them(tmp_path):
    config = tmp_path / "config.properties"
    config.write_text("inference_address=http://0.0.0.0:9080/\nmanagement_address=http://127.0.0.1:9081\n")
    assert default_url("inference", config) == "http://127.0.0.1:9080"
    assert default_url("management", config) == "http://127.0.0.1:9081"
    config.write_text("metrics_address=http://127.0.0.1:9082\n")
    assert default_url("inference", config) == DEFAULT_URLS["inference"] == "http://127.0.0.1:8080"
    assert default_url("management", tmp_path / "absent") == "http://127.0.0.1:8081"


def test_the_key_file_in_the_working_directory_is_read_only_when_no_key_is_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert default_key_file(None, key_known=False) is None  # nothing there
    (tmp_path / "key_file.json").write_text("{}")
    assert str(default_key_file(None, key_known=False)) == "key_file.json"
    assert default_key_file(None, key_known=True) is None  # --key or an exported key wins
    assert default_key_file(tmp_path / "other.json", key_known=False) == tmp_path / "other.json"


@pytest.mark.parametrize("named, listed, model", [
    ({"minilm"}, Listed(["minilm", "tiny"]), "minilm"),  # the lines' model, registered
    ({"minilm"}, None, "minilm"),  # nothing to check it against: as written
    ({"minilm"}, Listed(error=OSError("refused")), "minilm"),
    (set(), Listed(["minilm"]), "minilm"),  # a table, or lines naming none: the only model
])
def test_the_model_is_the_lines_or_the_only_one(named, listed, model):
    assert choose_model(named, listed) == (model, None)


def test_a_name_the_server_lacks_goes_to_its_only_model_and_says_so():
    model, note = choose_model({"text-embedding-3-small"}, Listed(["minilm"]))
    assert model == "minilm" and "'text-embedding-3-small' is not a model of this server" in note


@pytest.mark.parametrize("named, listed, message", [
    ({"a", "b"}, Listed(["a", "b"]), r"name 2 models in body.model \(a, b\).*give --model"),
    (set(), Listed(["a", "b"]), r"the 2 models registered at http://127.0.0.1:8081 \(a, b\): give --model"),
    ({"c"}, Listed(["a", "b"]), r"body.model 'c' is not one of the 2 models registered"),
    (set(), Listed([]), r"the 0 models registered .*\(none\)"),
    (set(), None, r"names none \(body.model\) while no --management-url"),
    (set(), Listed(error=OSError("Connection refused")), r"could not list them \(Connection refused\)"),
])
def test_without_a_model_to_choose_the_job_stops_saying_why(named, listed, message):
    with pytest.raises(JobError, match=message):
        choose_model(named, listed)
