import dataclasses

import pytest

from embedserve.handler.settings import Settings, SettingsError, switch


def test_defaults_are_valid():
    settings = Settings.from_mapping(None)
    assert settings == Settings()
    assert settings.normalize is True and settings.pooling == "auto"


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().normalize = False


def test_yaml_string_spellings_are_accepted():
    settings = Settings.from_mapping({"normalize": "false", "max_length": "128"})
    assert settings.normalize is False and settings.max_length == 128


@pytest.mark.parametrize(
    "section, key",
    [
        ({"dtyp": "float32"}, "dtyp"),
        ({"dtype": "float64"}, "dtype"),
        ({"pooling": "median"}, "pooling"),
        ({"device": "tpu"}, "device"),
        ({"normalize": "yes"}, "normalize"),
        ({"max_length": -1}, "max_length"),
        ({"max_length": True}, "max_length"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_tokens": "many"}, "max_batch_tokens"),
        ({"max_batch_tokens": -1}, "max_batch_tokens"),
        ({"cpu_threads": -2}, "cpu_threads"),
        ({"pass_overhead_tokens": -1}, "pass_overhead_tokens"),
        ({"model_path": ""}, "model_path"),
        ({"model_path": 3}, "model_path"),
        ({"image_url_hosts": ["http://images.internal"]}, "image_url_hosts"),
        ({"image_url_hosts": ["images.internal/cats"]}, "image_url_hosts"),
        ({"image_url_hosts": ["*.internal"]}, "image_url_hosts"),
        ({"image_url_hosts": "images.internal"}, "image_url_hosts"),
        ({"image_url_timeout_s": 0}, "image_url_timeout_s"),
        ({"max_image_pixels": 0}, "max_image_pixels"),
        ({"max_images_per_request": 0}, "max_images_per_request"),
        ({"max_image_bytes": 20 * 2**20}, "max_image_bytes"),  # over max_image_request_bytes
    ],
)
def test_bad_setting_names_its_key(section, key):
    with pytest.raises(SettingsError) as caught:
        Settings.from_mapping(section)
    assert caught.value.key == key
    assert f"'{key}'" in str(caught.value)


def test_layer_list_setting():
    assert Settings.from_mapping({"int8_fp32_layers": ["x", "y"]}).int8_fp32_layers == ("x", "y")
    with pytest.raises(SettingsError, match="int8_fp32_layers"):
        Settings.from_mapping({"int8_fp32_layers": "x"})


@pytest.mark.parametrize("key", ["cuda_graphs", "packed"])
def test_graphs_and_packed_passes_are_on_where_a_gpu_serves(key):
    """auto (the default): on a GPU, off elsewhere; true and false as written."""
    assert getattr(Settings(), key) == "auto"
    assert [switch(Settings.from_mapping({key: v}).__getattribute__(key), on_gpu) for v in ("auto", "AUTO")
            for on_gpu in (True, False)] == [True, False, True, False]
    for value, expected in ((True, True), ("true", True), (False, False), ("false", False)):
        resolved = Settings.from_mapping({key: value}).__getattribute__(key)
        assert switch(resolved, on_gpu=True) is expected and switch(resolved, on_gpu=False) is expected
    with pytest.raises(SettingsError, match=key):
        Settings.from_mapping({key: "sometimes"})


def test_image_url_hosts_are_none_by_default_and_hosts_or_host_ports():
    assert Settings().image_url_hosts == ()
    hosts = Settings.from_mapping({"image_url_hosts": ["images.internal", "127.0.0.1:9000"]}).image_url_hosts
    assert hosts == ("images.internal", "127.0.0.1:9000")
