"""scripts/gpu_run.sh, the one command for a GPU machine, in its CPU mode: every step runs, each
leaves its file, and a step that fails does not stop the next."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

FAMILIES = ("bert_dense", "qwen3")  # one with packed passes, one that falls back to padded ones


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu-run")
    env = {**os.environ, "PY": sys.executable, "GPU_RUN_DEVICE": "cpu", "GPU_RUN_MODEL": "none",
           # Small, for two shared cores: two families (and one that cannot start), few texts.
           "GPU_RUN_FAMILIES": " ".join(FAMILIES) + " no_such_family", "GPU_RUN_FAMILY_TEXTS": "24",
           "BENCH_GPU_ARGS": "--texts 16 --repeats 3 --saturation-texts 32"}
    done = subprocess.run(["bash", "scripts/gpu_run.sh", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    return out, done


def test_every_step_runs_and_leaves_its_file(run):
    out, done = run
    assert done.returncode == 0, done.stdout[-4000:]
    for name in ("gpu_run.log", "steps.tsv", "capture_probe.json", "families.json", "gpu.json"):
        assert (out / name).stat().st_size > 0, name
    assert "== gpu_run done" in (out / "gpu_run.log").read_text()
    steps = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
    # One family cannot start (no_such_family): the families step says so, and the next step runs.
    assert steps == {"wheels": "0", "versions": "0", "capture-probe": "0", "families": "1", "bench.gpu": "0"}


def test_families_cpu_modes_match_the_reference(run):
    families = json.loads((run[0] / "families.json").read_text())
    assert set(families) == {*FAMILIES, "no_such_family"}
    for family in FAMILIES:
        row = families[family]
        assert row["ok"] and row["device"] == "cpu" and row["exit_code"] == 0, row
        assert set(row["modes"]) == {"float32_eager", "bfloat16_eager", "float32_packed"}
        for mode in row["modes"].values():
            assert mode["started"] and mode["min_cosine"] >= 0.999 and mode["non_finite_rows"] == 0, mode
    assert families["bert_dense"]["modes"]["float32_packed"]["layout"] == "packed"
    # A family process that dies is recorded with its log's tail, and the others' figures stand.
    assert not families["no_such_family"]["ok"] and "invalid choice" in families["no_such_family"]["died"]


def test_probe_and_benchmark_in_cpu_mode(run):
    out = run[0]
    probe = json.loads((out / "capture_probe.json").read_text())
    assert probe["device"] == "cpu" and probe["raw"] == {"skipped": "no CUDA device"}
    sync = probe["sync_check"]
    assert sync["exit_code"] == 0 and sync["quiet_pass"] is None and "_local_scalar_dense" in sync["reading_pass"], sync
    report = json.loads((out / "gpu.json").read_text())
    assert report["complete"] and "errors" not in report and report["device"] == "cpu"
    assert report["plan"]["texts"] == 16  # BENCH_GPU_ARGS reached bench.gpu
    assert all(row["met"] for row in report["targets"] if row["applicable"])
