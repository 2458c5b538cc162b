"""scripts/gpu_peer.sh in its CPU mode: the real Infinity (bench/peer_requirements.txt's pins,
installed from the package index into an environment of its own, as a user installs it) serves the
tiny model; the load client runs the script's shapes against its OpenAI route; peer.json holds each
shape's figures and the versions Infinity ran with. A peer that cannot start is named, not hidden.

On a GPU the same script stages those pins as wheels (build/gpu/peer.tar) before the machine's own
packages instead: that path needs the GPU machine and is not run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.integration

SHAPES = [(1, 1), (16, 1), (8, 32)]
PEER_ENV = Path.home() / ".cache" / "embedserve" / "peer-infinity-0.0.78"


@pytest.fixture(scope="module")
def infinity_python() -> Path:
    """An interpreter with Infinity at the pinned versions (made once, kept for later runs)."""
    python = PEER_ENV / "bin" / "python"
    if not (PEER_ENV / ".ready").is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_ENV)], check=True, timeout=120)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "-r", str(REPO / "bench" / "peer_requirements.txt"), "torch==2.13.0"],
                       check=True, timeout=900)
        (PEER_ENV / ".ready").write_text("")
    return python


def _run(out: Path, python: Path, model: Path, timeout: float, **settings: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PY": sys.executable, "GPU_PEER_DEVICE": "cpu", "GPU_PEER_WHEELS": "installed",
           "GPU_PEER_PYTHON": str(python), "GPU_PEER_MODEL": str(model), **settings}
    return subprocess.run(["bash", "scripts/gpu_peer.sh", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, infinity_python) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu-peer")
    done = _run(out, infinity_python, tiny_model_dir, 240, GPU_PEER_SECONDS="150",
                GPU_PEER_SHAPES=" ".join(f"{c}x{t}" for c, t in SHAPES),
                GPU_PEER_SHAPE_SECONDS="2", GPU_PEER_WARMUP_SECONDS="1")
    return out, done


def test_every_step_passes_and_leaves_its_files(run):
    out, done = run
    assert done.returncode == 0, done.stdout[-4000:]
    for name in ("peer.json", "peer_server.log", "gpu_peer.log", "steps.tsv"):
        assert (out / name).stat().st_size > 0, name
    assert [line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines()] == \
        [["stage", "0"], ["peer", "0"]]


def test_peer_json_has_every_shape_without_errors_and_the_peer_s_versions(run):
    report = json.loads((run[0] / "peer.json").read_text())
    assert report["complete"] and report["failed_step"] is None and not report["errors"], report.get("errors")
    assert (report["peer"], report["device"], report["dtype"]) == ("infinity", "cpu", "float32")
    assert report["versions"]["infinity_emb"] == "0.0.78" and report["versions"]["transformers"].startswith("4.")
    assert report["startup"]["ready_s"] > 0 and report["startup"]["status"] == 200
    assert report["startup"]["dimension"] == 32  # the tiny model's vectors
    assert [(row["clients"], row["texts_per_request"]) for row in report["shapes"]] == SHAPES
    for row in report["shapes"]:
        assert row["errors"] == {} and row["requests"] > 0 and row["texts_per_s"] > 0, row
        assert row["texts"] == row["requests"] * row["texts_per_request"]
        assert 0 < row["p50_ms"] <= row["p99_ms"] and row["server_cores"] > 0, row
        assert "frontend_cores" not in row and "gpu_util_mean" not in row


def test_a_peer_that_cannot_start_is_named(tmp_path, tiny_model_dir):
    """An interpreter without Infinity: the stage step fails, saying what is missing."""
    done = _run(tmp_path, Path(sys.executable), tiny_model_dir, 120, GPU_PEER_SECONDS="60")
    assert done.returncode != 0
    assert "MISSING: Infinity, importable by" in done.stdout
    assert [line.split("\t")[:2] for line in (tmp_path / "steps.tsv").read_text().splitlines()] == [["stage", "1"]]
