"""CPU lending on every engine a CPU worker can serve with: a lone small pass runs on its own CPU
and every idle one, in the runtime itself (ONNX Runtime's session and OpenVINO's compiled model
for that many threads, torch's intra-op threads), and on its own CPU alone while the other
worker holds its batch. The service is assembled as a worker of a two-worker server on two
CPUs is (make serve's default), with real file locks standing for the other worker."""

import json

import numpy as np
import pytest
import torch

from embedserve.handler.api.exchange import RawRequest
from embedserve.handler.assembly import assemble
from embedserve.handler.backends import onnx_runtime, openvino_runtime
from embedserve.handler.backends.openvino_runtime import openvino_available
from embedserve.handler.settings import Settings
from embedserve.handler.torchserve.profile import TORCHSERVE
from embedserve.handler.worker import cpu_lending
from embedserve.handler.worker.cpu_lending import CpuLending

ENGINES = [("torch", "float32"), ("torch", "bfloat16"), ("onnxruntime", "float32"),
           pytest.param("openvino", "float32", marks=pytest.mark.skipif(not openvino_available(), reason="no openvino")),
           pytest.param("openvino", "bfloat16", marks=pytest.mark.skipif(not openvino_available(), reason="no openvino"))]


@pytest.fixture
def two_cpus(monkeypatch, tmp_path):
    """This process stands for one of two workers on a two-CPU machine; the lock files live in tmp_path."""
    monkeypatch.setattr("embedserve.handler.execution.placement.available_cpus", lambda: 2)
    monkeypatch.setattr(cpu_lending, "lock_directory", lambda: tmp_path)
    return tmp_path


@pytest.fixture
def runtime_threads(monkeypatch):
    """The thread count of each runtime a pass ran on: the session or compiled model an ONNX Runtime
    or OpenVINO pass picked, or torch's own count for a torch pass."""
    seen: list[int] = []

    def spy(by_threads, threads):
        chosen = cpu_lending.for_threads(by_threads, threads)
        seen.append(next(count for count, runtime in by_threads.items() if runtime is chosen))
        return chosen

    monkeypatch.setattr(onnx_runtime, "for_threads", spy)
    monkeypatch.setattr(openvino_runtime, "for_threads", spy)
    return seen


@pytest.mark.parametrize("engine,dtype", ENGINES)
def test_a_lone_pass_runs_on_every_idle_cpu_on_each_engine(onnx_model_dir, two_cpus, runtime_threads, engine, dtype):
    settings = Settings.from_mapping({"device": "cpu", "engine": engine, "dtype": dtype, "warmup": False})
    service = assemble(onnx_model_dir, settings, model_name="tiny", workers=2, cuda_available=False, warm=False,
                       server=TORCHSERVE)
    encoder = service.encoder
    assert (encoder.placement.cpu_threads, encoder.placement.lend_cpus) == (1, 2)
    assert encoder.lending is not None and encoder.lending.home == [0]
    if engine == "torch":  # torch runs on its intra-op threads: note their count at each pass
        run = encoder.backend.run
        encoder.backend.run = lambda prepared, **kw: (runtime_threads.append(torch.get_num_threads()),
                                                      run(prepared, **kw))[1]
    other_worker = CpuLending.join(2, 1, two_cpus)
    assert other_worker.home == [1]

    def embed(text: str):
        [response] = service.handle([RawRequest(json.dumps({"input": text}).encode(), "application/json", "")])
        assert response.status == 200, response.body
        return np.array(json.loads(response.body)["data"][0]["embedding"]), response.headers["server-timing"]

    lent, lent_timing = embed("the cat sat on the mat")  # the other worker idle: both CPUs
    with other_worker.batch():
        own, own_timing = embed("the cat sat on the mat")  # the other worker busy: its own CPU only
    assert runtime_threads == [2, 1]
    assert 'model;dur=' in lent_timing and 'desc="2 CPU threads"' in lent_timing
    assert 'desc="1 CPU threads"' in own_timing
    assert torch.get_num_threads() == 1  # back to the worker's share after each pass
    np.testing.assert_allclose(lent, own, atol=2e-2 if dtype == "bfloat16" else 1e-5)
