"""bench/gpu_host_probe.py in CPU mode on the tiny model: every phase and variant comes back with its
figures, and a process that fails stops the run at once instead of leaving the others waiting."""

import json
import subprocess
import sys

from tests.support import REPO


def _probe(model, out, *extra):
    return subprocess.run([sys.executable, "-m", "bench.gpu_host_probe", str(model), "--device", "cpu",
                           "--procs", "2", "--seconds", "0.3", "--requests", "2", "--per", "4",
                           "--out", str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=240)


def test_every_phase_comes_back_with_its_figures(tiny_model_dir, tmp_path):
    done = _probe(tiny_model_dir, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "host_probe.json").read_text())
    assert set(report["summary"]) == {"solo-torch-default", "solo-served", "all-torch-default", "all-served",
                                      "all-threads-share", "all-share-blocking"}
    for name, row in report["summary"].items():
        assert row["procs"] == (1 if name.startswith("solo") else 2)
        assert row["texts_per_s"] > 0 and row["cpu_us_per_text"] > 0
        assert {"parse", "tokenize", "model", "encode"} <= set(row["stage_us_per_text_rank0"])
    # The listing keeps the 25 costliest functions by their own time: which ones they are varies with the
    # machine (handle_with_report, with little time of its own, was among them here and not on CI's), so the
    # test asks only that a profile came back.
    profile = report["rows"][0]["profile"]
    assert "function calls" in profile and "Ordered by: internal time" in profile


def test_a_failed_process_stops_the_run(tmp_path):
    done = _probe(tmp_path / "no-model", tmp_path / "out")
    assert done.returncode != 0
    assert "an engine's process failed" in done.stderr
