"""scripts/gpu_serve.sh, end to end through TorchServe, in its CPU mode: the installed Java and the
environment's TorchServe serve the tiny model, each load shape runs for a few seconds, the model
is scaled from its one worker to two (the worker sweep) and a shape runs again there, and
serving.json holds each shape's figures; a missing model stops the run at its first step, named.

The shapes are the script's, but 16 clients of 32-text requests stand for its 256: on two shared
cores one round of 256 such requests (8,192 texts) takes most of a minute."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.integration

SHAPES = [(1, 1), (64, 1), (256, 1), (16, 32)]
SWEEP = {"workers": 2, "shape": (16, 1)}  # the build's one worker scaled to two, one shape there
BATCH_TEXTS = 600  # `embedserve batch` after the shapes (100,000 on a GPU)


def _run(out: Path, stage: Path, timeout: float, **settings: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PY": sys.executable, "GPU_SERVE_DEVICE": "cpu", "GPU_SERVE_RUNTIME": "installed",
           "GPU_SERVE_STAGE": str(stage), **settings}
    return subprocess.run(["bash", "scripts/gpu_serve.sh", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu-serve")
    # Short, for two shared cores: 2 measured seconds per shape after 1 of warm-up.
    done = _run(out, tmp_path_factory.mktemp("stage"), 240, GPU_SERVE_MODEL=str(tiny_model_dir),
                GPU_SERVE_SHAPES=" ".join(f"{c}x{t}" for c, t in SHAPES), GPU_SERVE_SECONDS="130",
                GPU_SERVE_WORKERS=str(SWEEP["workers"]), GPU_SERVE_SWEEP_SHAPES="{}x{}".format(*SWEEP["shape"]),
                GPU_SERVE_MPS="1", GPU_SERVE_BATCH_TEXTS=str(BATCH_TEXTS),
                GPU_SERVE_SHAPE_SECONDS="2", GPU_SERVE_WARMUP_SECONDS="1")
    return out, done


def test_every_step_passes_and_leaves_its_files(run):
    out, done = run
    assert done.returncode == 0, done.stdout[-4000:]
    for name in ("serving.json", "gpu_serve.log", "steps.tsv", "ts_log.log", "model_log.log"):
        assert (out / name).stat().st_size > 0, name
    steps = [line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines()]
    assert steps == [["stage", "0"], ["install", "0"], ["build", "0"], ["serve", "0"], ["stop", "0"]]
    assert "== gpu_serve done" in (out / "gpu_serve.log").read_text()


def test_serving_json_has_every_shape_without_errors(run):
    report = json.loads((run[0] / "serving.json").read_text())
    assert report["complete"] and report["failed_step"] is None and not report["errors"], report.get("errors")
    assert report["device"] == "cpu" and report["gpu"]["available"] is False
    assert report["versions"]["torchserve"] and report["versions"]["java"].startswith(("openjdk", "java"))
    # What the machine offers a TensorRT engine (issue: recorded in every GPU run's JSON).
    assert report["tensorrt"]["onnxruntime_providers"] and report["tensorrt"]["onnxruntime_tensorrt"] is False
    assert report["startup"]["ready_s"] > 0 and report["startup"]["frontend_up_s"] <= report["startup"]["ready_s"]
    assert report["startup"]["all_workers_s"] >= report["startup"]["ready_s"]
    assert [(row["clients"], row["texts_per_request"], row["workers"]) for row in report["shapes"]] == \
        [(*shape, 1) for shape in SHAPES] + [(*SWEEP["shape"], SWEEP["workers"])]
    for row in report["shapes"]:
        assert row["errors"] == {} and row["requests"] > 0 and row["texts_per_s"] > 0, row
        assert row["texts"] == row["requests"] * row["texts_per_request"]
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["load_processes"] >= 1 and row["frontend_cores"] >= 0 and row["workers_cores"] > 0, row
        assert "gpu_util_mean" not in row  # no GPU here
    target = report["target"]
    assert target["clients"] == 256 and target["met"] is False and target["best_shape"] == "256x1 at 1 workers"


def test_the_worker_sweep_scales_the_model_and_says_why_it_sizes_nothing_and_runs_no_mps_without_a_gpu(run):
    report = json.loads((run[0] / "serving.json").read_text())
    built, scaled = report["workers"]
    assert built == {"workers": 1, "gpu_mem_idle_mib": None}
    assert scaled["workers"] == SWEEP["workers"] and scaled["scale_s"] > 0 and scaled["gpu_mem_idle_mib"] is None
    assert report["sizing"] == {"why": "no GPU: memory per worker is measured on one"}
    assert report["mps"] == "asked; not run: no GPU"  # GPU_SERVE_MPS=1 here
    assert "1x1 at 1 workers" in run[1].stdout and "16x1 at 2 workers" in run[1].stdout
    assert [step["step"] for step in report["steps"]] == ["stage", "install", "build", "serve", "stop"]


def test_a_missing_model_stops_the_run_at_the_stage_step(tmp_path):
    done = _run(tmp_path / "out", tmp_path / "stage", 60, GPU_SERVE_MODEL=str(tmp_path / "no-model.tar.xz"))
    assert done.returncode == 1
    assert f"MISSING: {tmp_path / 'no-model.tar.xz'}" in done.stdout
    report = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert report["failed_step"] == "stage" and report["complete"] is False and report["mps"] == "off"
    assert [step["step"] for step in report["steps"]] == ["stage"]


def test_embedserve_batch_runs_against_the_server_after_the_shapes(run):
    """The bulk shape users send: `embedserve batch` of a table, every text answered, in order."""
    report = json.loads((run[0] / "serving.json").read_text())
    batch = report["batch"]
    assert batch["exit"] == 0 and batch["answered"] == batch["texts"] == BATCH_TEXTS, batch
    assert batch["texts_per_s"] > 0 and batch["seconds"] > 0 and "error" not in batch
    assert "embedserve batch of 600" in run[1].stdout


def test_the_sweep_plots_as_texts_per_second_against_workers(run, tmp_path):
    """bench/plot_workers.py on the run's own serving.json: the shapes at the build's one worker, the
    sweep's shape at two; no GPU busy figures here."""
    from bench.plot_workers import main, sweep

    report = json.loads((run[0] / "serving.json").read_text())
    assert {shape: [point[0] for point in points] for shape, points in sweep(report).items()} == \
        {**{shape: [1] for shape in SHAPES}, SWEEP["shape"]: [SWEEP["workers"]]}
    assert main([str(run[0] / "serving.json"), "--out", str(tmp_path / "workers.png")]) == 0
    assert (tmp_path / "workers.png").stat().st_size > 10_000
