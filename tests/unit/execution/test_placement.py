"""Where a worker runs: device, dtype, threads and batch budget from the settings, the GPU TorchServe
assigned, and the CPUs a cgroup allows."""

import json
import os
from unittest import mock

import pytest
import torch

from embedserve.handler.execution.placement import make_current, resolve_placement, worker_device
from embedserve.handler.settings import Settings


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


def test_available_cpus_honours_a_cgroup_limit(tmp_path):
    from embedserve.handler.execution.placement import available_cpus

    limit = tmp_path / "cpu.max"
    limit.write_text("150000 100000\n")  # 1.5 CPUs: two threads
    assert available_cpus(limit) == min(2, available_cpus(tmp_path / "absent"))
    limit.write_text("max 100000\n")
    assert available_cpus(limit) == available_cpus(tmp_path / "absent") >= 1


def test_cuda_graphs_are_ignored_on_a_cpu():
    settings = Settings.from_mapping({"device": "cpu", "cuda_graphs": True})
    placement = resolve_placement(settings, gpu_id=None, workers=1, cuda_available=False)
    assert placement.cuda_graph_buckets == ()


def test_a_worker_runs_on_the_gpu_torchserve_assigned():
    assert worker_device("cuda", 2, cuda_available=True) == torch.device("cuda:2")
    assert worker_device("auto", 3, cuda_available=True) == torch.device("cuda:3")
    assert worker_device("cuda", None, cuda_available=True) == torch.device("cuda:0")
    assert worker_device("cuda:1", 3, cuda_available=True) == torch.device("cuda:1")  # explicit: kept
    assert worker_device("auto", 3, cuda_available=False) == torch.device("cpu")
    assert worker_device("cpu", 3, cuda_available=True) == torch.device("cpu")
    placement = resolve_placement(Settings(device="cuda"), gpu_id=1, workers=2, cuda_available=True)
    assert placement.device == torch.device("cuda:1")


def test_the_worker_makes_its_gpu_current():
    with mock.patch("torch.cuda.set_device") as set_device:
        make_current(torch.device("cpu"))
        set_device.assert_not_called()
        make_current(torch.device("cuda:3"))
    set_device.assert_called_once_with(torch.device("cuda:3"))


@pytest.mark.parametrize("saved, expected", [("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                             ("float16", torch.float16), (None, torch.float16)])
def test_auto_dtype_on_a_gpu_follows_a_bfloat16_checkpoint(tmp_path, saved, expected):
    # Models trained in bfloat16 (the Qwen family) can overflow float16's range.
    expected = torch.float16 if expected == torch.float32 else expected  # half precision on a GPU
    key = "dtype" if saved == "bfloat16" else "torch_dtype"  # transformers 5 writes the first, 4.x the second
    (tmp_path / "config.json").write_text(json.dumps({key: saved} if saved else {}))
    placement = resolve_placement(Settings(device="cuda"), gpu_id=0, workers=1, cuda_available=True,
                                  model_dir=tmp_path)
    assert placement.dtype == expected
    forced = resolve_placement(Settings(device="cuda", dtype="float16"), gpu_id=0, workers=1, cuda_available=True,
                               model_dir=tmp_path)
    assert forced.dtype == torch.float16  # a dtype setting still forces the choice
    on_cpu = resolve_placement(Settings(device="cpu"), gpu_id=None, workers=1, cuda_available=False, model_dir=tmp_path)
    assert on_cpu.dtype == torch.float32


def test_a_gpu_worker_replays_graphs_of_packed_passes_by_default():
    gpu = resolve_placement(Settings(), gpu_id=0, workers=1, cuda_available=True)
    assert gpu.cuda_graphs and gpu.cuda_graph_buckets and gpu.packed
    off = resolve_placement(Settings(cuda_graphs=False, packed=False), gpu_id=0, workers=1, cuda_available=True)
    assert not off.cuda_graphs and not off.cuda_graph_buckets and not off.packed
    cpu = resolve_placement(Settings(), gpu_id=None, workers=1, cuda_available=False)
    assert not cpu.cuda_graphs and not cpu.packed  # a CPU worker: ONNX Runtime's padded passes


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma2"])
def test_gemma_runs_in_bfloat16_on_a_gpu_whatever_its_checkpoint(tmp_path, model_type):
    # EmbeddingGemma's activations exceed float16's range even from a float32 checkpoint.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "dtype": "float32"}))
    placement = resolve_placement(Settings(device="cuda"), gpu_id=0, workers=1, cuda_available=True,
                                  model_dir=tmp_path)
    assert placement.dtype == torch.bfloat16


def test_a_gpu_worker_s_tokenizer_pool_is_its_share_of_the_host_s_cores(monkeypatch):
    """Workers per GPU come from the host's cores; each one's tokenizer threads are its share of them."""
    monkeypatch.setattr("embedserve.handler.execution.placement.available_cpus", lambda: 16)
    assert resolve_placement(Settings(), gpu_id=0, workers=8, cuda_available=True).tokenizer_threads == 2
    assert resolve_placement(Settings(), gpu_id=0, workers=32, cuda_available=True).tokenizer_threads == 1
    assert resolve_placement(Settings(), gpu_id=None, workers=2, cuda_available=False).tokenizer_threads == 0


def test_the_tokenizer_pool_is_set_before_the_first_batch_and_the_environment_wins(monkeypatch):
    from embedserve.handler.model.tokenization import set_parallelism

    for name in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS"):  # set, then removed: restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    set_parallelism(2)
    assert (os.environ["TOKENIZERS_PARALLELISM"], os.environ["RAYON_NUM_THREADS"]) == ("true", "2")
    monkeypatch.setenv("RAYON_NUM_THREADS", "6")
    set_parallelism(3)
    assert os.environ["RAYON_NUM_THREADS"] == "6"
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    monkeypatch.delenv("RAYON_NUM_THREADS")
    set_parallelism(0)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false" and "RAYON_NUM_THREADS" not in os.environ


def test_a_gpu_worker_runs_torch_on_one_thread_unless_told(monkeypatch):
    """torch's default, every core in every GPU worker, let idle OpenMP threads spin on the cores the
    other workers needed (bench/gpu_host_probe.py on an H200): one thread, or what cpu_threads says."""
    monkeypatch.setattr("embedserve.handler.execution.placement.available_cpus", lambda: 16)
    gpu = resolve_placement(Settings(), gpu_id=0, workers=8, cuda_available=True)
    assert (gpu.torch_threads, gpu.cpu_threads) == (1, 0)
    assert resolve_placement(Settings(cpu_threads=3), gpu_id=0, workers=8, cuda_available=True).torch_threads == 3
    assert resolve_placement(Settings(), gpu_id=None, workers=2, cuda_available=False).torch_threads == 8


def test_placement_applies_its_torch_threads(monkeypatch):
    from embedserve.handler.execution.placement import apply_placement

    monkeypatch.setattr("embedserve.handler.execution.placement.available_cpus", lambda: 16)
    gpu = resolve_placement(Settings(), gpu_id=0, workers=8, cuda_available=True)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr("embedserve.handler.execution.placement.make_current", lambda device: None)
    apply_placement(gpu)
    assert calls == [1]
