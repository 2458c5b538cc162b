"""scripts/gpu_run.sh, the one command for a GPU machine, in its CPU mode: every step runs, each
leaves its file, and a step that fails does not stop the next."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

# One with packed passes, one that falls back to padded ones, one of three outputs (bge-m3's).
FAMILIES = ("bert_dense", "qwen3", "m3")


# A section forced to fail (BENCH_GPU_FAIL): the dry run of a failure on the GPU machine.
FORCED = "engine.float32_packed"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu-run")
    env = {**os.environ, "PY": sys.executable, "GPU_RUN_DEVICE": "cpu", "GPU_RUN_MODEL": "none",
           # Small, for two shared cores: two families (and one that cannot start), few texts.
           "GPU_RUN_FAMILIES": " ".join(FAMILIES) + " no_such_family", "GPU_RUN_FAMILY_TEXTS": "24",
           "GPU_RUN_FAMILY_MODELS": "",  # each family made in its process, as on a clean clone
           "BENCH_GPU_ARGS": "--texts 16 --repeats 3 --saturation-texts 32", "BENCH_GPU_FAIL": FORCED}
    done = subprocess.run(["bash", "scripts/gpu_run.sh", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=450)
    return out, done


def test_every_step_runs_and_leaves_its_file(run):
    out, done = run
    log = (out / "gpu_run.log").read_text()
    # A failed section and a family that cannot start: the run says so in its status and its log.
    assert done.returncode == 1, done.stdout[-4000:]
    for name in ("gpu_run.log", "steps.tsv", "capture_probe.json", "families.json", "gpu.json", "images.json"):
        assert (out / name).stat().st_size > 0, name
    assert "== steps that did not succeed: bench.gpu (exit 1) families (exit 1)" in log
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    # The headline first; one family cannot start (no_such_family): the next step runs all the same.
    assert [(name, rc) for name, rc, _ in steps] == [("prerequisites", "0"), ("bench.gpu", "1"), ("families", "1"),
                                                     ("capture-probe", "0"), ("images", "0")]
    assert sum(int(seconds) for *_, seconds in steps) <= 400  # within the shared budget


def test_a_failed_section_costs_only_its_own_figures(run):
    report = json.loads((run[0] / "gpu.json").read_text())
    assert report["complete"] and report["device"] == "cpu"
    assert report["plan"]["texts"] == 16  # BENCH_GPU_ARGS reached bench.gpu
    # The forced failure, and the sections that needed its engine, each with its reason.
    assert report["errors"] == {FORCED: "forced failure (BENCH_GPU_FAIL)",
                                "correctness.float32_packed": "skipped: needs float32_packed, which failed",
                                "packed": "skipped: needs float32_packed, which failed"}
    # Every other section's figures came back.
    assert set(report["correctness"]["modes"]) == {"float32_eager", "bfloat16_eager"}
    assert len(report["correctness"]["adversarial"]) == 4 and report["latency"] and report["handle"]
    assert {"minilm", "bert_base"} <= set(report["saturation"]) and "float32_packed" not in report["engines"]
    # Every target: a value, or none with the reason.
    targets = {row["target"].split(":")[0]: row for row in report["targets"]}
    for row in targets.values():
        assert row["measured"] is not None or row["reason"], row
    packed = targets["packed passes"]
    assert packed["measured"] is None and packed["met"] is None and FORCED in packed["reason"]
    cosine = targets["every mode"]
    assert cosine["measured"]["float32_eager"] > 0.9999 and cosine["met"] is False  # a mode is missing
    assert "correctness.float32_packed" in cosine["reason"]


def test_families_cpu_modes_match_the_reference(run):
    families = json.loads((run[0] / "families.json").read_text())
    assert set(families) == {*FAMILIES, "no_such_family"}
    for family in FAMILIES:
        row = families[family]
        assert row["ok"] and row["complete"] and row["device"] == "cpu" and row["exit_code"] == 0, row
        assert set(row["modes"]) == {"float32_eager", "bfloat16_eager", "float32_packed"}
        for mode in row["modes"].values():
            assert mode["started"] and mode["min_cosine"] >= 0.999 and mode["non_finite_rows"] == 0, mode
    assert families["bert_dense"]["modes"]["float32_packed"]["layout"] == "packed"
    # bge-m3: each output against the reference's, and why its passes stay padded.
    m3 = families["m3"]["modes"]["float32_packed"]
    assert set(m3["outputs"]) == {"dense", "sparse", "colbert"}, m3
    assert all(row["min_cosine"] >= 0.9999 and row["shape_mismatches"] == 0 for kind, row in m3["outputs"].items()
               if kind != "dense"), m3
    assert m3["layout"] == "padded" and "reads its own" in m3["selected_by"]["layout"]
    # A family process that dies is recorded with its log's tail, and the others' figures stand.
    assert not families["no_such_family"]["ok"] and "invalid choice" in families["no_such_family"]["died"]


def test_probe_in_cpu_mode(run):
    probe = json.loads((run[0] / "capture_probe.json").read_text())
    assert probe["device"] == "cpu" and probe["raw"] == {"skipped": "no CUDA device"}
    sync = probe["sync_check"]
    assert sync["exit_code"] == 0 and sync["quiet_pass"] is None and "_local_scalar_dense" in sync["reading_pass"], sync


def test_images_in_cpu_mode_match_the_libraries(run):
    """The image step on the tiny CLIP, ColPali and ColQwen2: every request answered, the vectors
    the libraries' (sentence-transformers' encode; transformers' processor and model), and each
    figure there."""
    images = json.loads((run[0] / "images.json").read_text())
    assert images["complete"] and images["device"] == "cpu" and "errors" not in images, images.get("errors")
    assert set(images["models"]) == {"clip", "colpali", "colqwen2"}
    for name, row in images["models"].items():
        handler = row["handler"]
        assert set(handler["statuses"]) == {"200"} and handler["dtype"] == "float32", (name, handler)
        assert handler["images_per_s"] > 0 and handler["host_over_model"] > 0 and row["reference"]["images_per_s"] > 0
        assert {"parse", "tokenize", "model", "encode"} <= set(handler["ms_per_batch"]), handler
        assert row["min_cosine_to_float32"] >= 0.99999, (name, row)


def test_a_missing_prerequisite_is_named_and_nothing_else_runs(tmp_path):
    env = {**os.environ, "PY": sys.executable, "GPU_RUN_DEVICE": "cpu", "GPU_RUN_MODEL": str(tmp_path / "no-model")}
    done = subprocess.run(["bash", "scripts/gpu_run.sh", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"MISSING: {tmp_path / 'no-model'}" in done.stdout and "a prerequisite is missing" in done.stdout
    assert (tmp_path / "out" / "steps.tsv").read_text().split("\t")[:2] == ["prerequisites", "1"]
    assert not (tmp_path / "out" / "gpu.json").exists()


def test_a_packed_model_is_unpacked_before_the_checks(tmp_path):
    # make gpu-travel carries the model as MODEL.tar.xz: the prerequisites unpack it beside itself.
    import tarfile

    (tmp_path / "src" / "model").mkdir(parents=True)
    (tmp_path / "src" / "model" / "config.json").write_text("{}")
    with tarfile.open(tmp_path / "model.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "src" / "model", arcname="model")
    # No CUDA here: the prerequisites stop the run after the unpacking, naming what is missing.
    env = {**os.environ, "PY": sys.executable, "GPU_RUN_DEVICE": "cuda", "GPU_RUN_MODEL": str(tmp_path / "model")}
    done = subprocess.run(["bash", "scripts/gpu_run.sh", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"unpacked {tmp_path / 'model'}.tar.xz" in done.stdout and (tmp_path / "model" / "config.json").is_file()
    assert "MISSING: a working GPU" in done.stdout and "a prerequisite is missing" in done.stdout
