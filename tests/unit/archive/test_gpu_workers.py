"""Workers per GPU (embedserve/archive/gpu_workers.py): the rule from the machine's figures, the
probe's protocol, the probe itself on a CPU, and a GPU build that records its sizing.

No GPU runs here: the memory term's reading (torch.cuda.mem_get_info around the probe at its
peak) is replaced by given figures, and the probe runs its engine on the CPU; what a real GPU
worker holds, and the count's speed, are scripts/gpu_serve.sh's to measure (docs/gpu.md)."""

from __future__ import annotations

import json
import sys
import zipfile

import pytest
import yaml

from embedserve.archive import build
from embedserve.archive.gpu_workers import ProbeError, measure_footprint, size_workers
from tests.unit.archive.test_build import config, run_build  # noqa: F401  (config: the build's fixture)


def test_the_cores_give_one_worker_per_two_at_least_two_and_memory_caps_them():
    assert size_workers(16, 1).per_gpu == 8  # no memory figure: cores alone
    assert size_workers(16, 1, footprint_mib=2_000, memory_mib=143_771).per_gpu == 8  # 57 would fit
    tight = size_workers(16, 1, footprint_mib=30_000, memory_mib=143_771)
    assert (tight.per_gpu, tight.by_cores, tight.by_memory) == (3, 8, 3)  # 80% of the GPU: 3 x 30 GB
    assert size_workers(16, 2).per_gpu == 4 and size_workers(16, 2).workers == 8
    assert size_workers(2, 1).per_gpu == 2 and size_workers(1, 1).per_gpu == 2  # a second overlaps the first
    assert size_workers(4, 1, 200_000, 80_000).per_gpu == 1  # a worker that does not fit twice
    assert tight.describe() == ("3 workers per GPU (16 cores for 1 GPU(s) at 2 a worker: 8; 30000 MiB a worker at "
                                "its largest pass, 3 within 80% of 143771 MiB)")
    assert "memory not measured (--skip-check)" in size_workers(16, 1, why_not="--skip-check").describe()


def readings(*values):
    """The device's (used, total) MiB, reading after reading."""
    values = iter(values)
    return lambda: (next(values), 143_771)


def test_the_footprint_is_the_memory_used_with_the_probe_at_its_peak_less_before():
    holding = [sys.executable, "-c", "import sys; print('peak', flush=True); sys.stdin.readline()"]
    assert measure_footprint(None, {}, command=holding, used_mib=readings(1_000, 3_500)) == (2_500, 143_771)


def test_a_probe_that_fails_says_why():
    failing = [sys.executable, "-c", "import sys; sys.exit('CUDA error: out of memory')"]
    with pytest.raises(ProbeError, match="ended before its largest pass: CUDA error: out of memory"):
        measure_footprint(None, {}, command=failing, used_mib=readings(1_000))


def test_the_probe_runs_a_worker_s_largest_pass_and_holds_it(tiny_model_dir):
    """The probe's own code, its engine on the CPU: it loads the model as a worker does, runs the
    largest pass the work bound holds, says so, and waits."""
    handler = {"device": "auto", "dtype": "float32", "max_batch_tokens": 4096}
    command = [sys.executable, "-m", "embedserve.archive.gpu_workers", str(tiny_model_dir), json.dumps(handler), "cpu"]
    assert measure_footprint(None, handler, command=command, used_mib=readings(0, 7))[0] == 7


@pytest.fixture
def gpu_machine(monkeypatch):
    """A build machine with one GPU, whose probe measures 30 GB a worker of a 140 GB GPU."""
    monkeypatch.setattr(build, "_gpus", lambda args: 1)
    monkeypatch.setattr(build, "available_cpus", lambda: 16)
    monkeypatch.setattr(build, "size_for_gpus", lambda model_dir, handler, gpus: size_workers(16, gpus, 30_000, 143_771))


def archived(config, name):
    with zipfile.ZipFile(config.parent / "store" / f"{name}.mar") as archive:
        return yaml.safe_load(archive.read("model-config.yaml"))


def test_a_gpu_build_sizes_its_workers_and_records_why(tiny_model_dir, config, capsys, gpu_machine):
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "sized", "--skip-check") == 0
    assert "workers: 8 workers per GPU (16 cores" in capsys.readouterr().err  # --skip-check: no probe, cores alone
    assert archived(config, "sized")["minWorkers"] == 8
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "probed", "--set", "engine=torch") == 0
    made = archived(config, "probed")
    assert (made["minWorkers"], made["maxWorkers"]) == (3, 3)
    assert made["handler"]["workers_sizing"].startswith("3 workers per GPU") and "30000 MiB a worker" in \
        made["handler"]["workers_sizing"]
    assert "workers: 3 workers per GPU" in capsys.readouterr().err
    assert run_build(config, "--model", str(tiny_model_dir), "--name", "set", "--workers", "5", "--skip-check") == 0
    assert archived(config, "set")["minWorkers"] == 5 and "workers_sizing" not in archived(config, "set")["handler"]


def test_info_says_the_build_s_sizing(tiny_model_dir):
    from embedserve.handler.api.exchange import RawRequest
    from embedserve.handler.assembly import assemble
    from embedserve.handler.settings import Settings

    sizing = size_workers(16, 1, 30_000, 143_771).describe()
    service = assemble(tiny_model_dir, Settings(workers_sizing=sizing), model_name="tiny", cuda_available=False)
    [answer] = service.handle([RawRequest(None, None, "info")])
    assert json.loads(answer.body)["workers_sizing"] == sizing
