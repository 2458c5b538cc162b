import dataclasses

import pytest
import torch

from embedserve.handler.execution.placement import resolve_placement
from embedserve.handler.settings import Settings, SettingsError


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
    ],
)
def test_bad_setting_names_its_key(section, key):
    with pytest.raises(SettingsError) as caught:
        Settings.from_mapping(section)
    assert caught.value.key == key
    assert f"'{key}'" in str(caught.value)


def test_cpu_placement_defaults_to_float32_and_splits_cores(monkeypatch):
    monkeypatch.setattr("embedserve.handler.execution.placement.available_cpus", lambda: 8)
    placement = resolve_placement(Settings(), gpu_id=None, workers=2, cuda_available=False)
    assert placement.device == torch.device("cpu")
    assert placement.dtype == torch.float32
    assert placement.cpu_threads == 4


def test_batch_token_budget_and_padding_follow_the_device():
    cpu = resolve_placement(Settings(), gpu_id=None, workers=1, cuda_available=False)
    gpu = resolve_placement(Settings(), gpu_id=0, workers=1, cuda_available=True)
    assert (cpu.max_batch_tokens, cpu.pad_multiple) == (1024, 1)
    assert (gpu.max_batch_tokens, gpu.pad_multiple) == (16384, 8)
    assert resolve_placement(Settings(max_batch_tokens=300), None, 1, False).max_batch_tokens == 300


def test_explicit_cpu_threads_win():
    placement = resolve_placement(Settings(cpu_threads=3), gpu_id=None, workers=2, cuda_available=False)
    assert placement.cpu_threads == 3


def test_gpu_placement_uses_assigned_gpu_and_half_precision():
    placement = resolve_placement(Settings(), gpu_id=1, workers=1, cuda_available=True)
    assert placement.device == torch.device("cuda:1")
    assert placement.dtype == torch.float16
    assert placement.cpu_threads == 0
    bf16 = resolve_placement(Settings(dtype="bfloat16"), gpu_id=0, workers=1, cuda_available=True)
    assert bf16.dtype == torch.bfloat16


def test_float16_on_cpu_is_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="'dtype'"):
        resolve_placement(Settings(dtype="float16"), gpu_id=None, workers=1, cuda_available=False)


def test_cuda_requested_without_cuda_is_refused():
    with pytest.raises(ValueError, match="'device'"):
        resolve_placement(Settings(device="cuda"), gpu_id=None, workers=1, cuda_available=False)


def test_int8_is_a_cpu_mode():
    placement = resolve_placement(Settings(dtype="int8", int8_fp32_layers=("a.b",)), None, 1, cuda_available=False)
    assert placement.dtype == torch.float32 and placement.int8_fp32_layers == ("a.b",)
    assert resolve_placement(Settings(), None, 1, False).int8_fp32_layers is None
    with pytest.raises(ValueError, match="'dtype': int8 is a CPU mode"):
        resolve_placement(Settings(dtype="int8"), gpu_id=0, workers=1, cuda_available=True)


def test_layer_list_setting():
    assert Settings.from_mapping({"int8_fp32_layers": ["x", "y"]}).int8_fp32_layers == ("x", "y")
    with pytest.raises(SettingsError, match="int8_fp32_layers"):
        Settings.from_mapping({"int8_fp32_layers": "x"})


def test_available_cpus_honours_a_cgroup_limit(tmp_path):
    from embedserve.handler.execution.placement import available_cpus

    limit = tmp_path / "cpu.max"
    limit.write_text("150000 100000\n")  # 1.5 CPUs: two threads
    assert available_cpus(limit) == min(2, available_cpus(tmp_path / "absent"))
    limit.write_text("max 100000\n")
    assert available_cpus(limit) == available_cpus(tmp_path / "absent") >= 1
