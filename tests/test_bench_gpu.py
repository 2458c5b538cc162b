"""`python -m bench.gpu` in CPU mode: the GPU benchmark's every step on a tiny model, as CI runs it."""

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.gpu import check_targets, compare, plot, write_fp16_copy

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench-gpu")
    # A child process: the benchmark sets torch's threads, which must not leak into other tests.
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "gpu.json").read_text()), out


def test_cpu_mode_reports_every_section(results):
    report, out = results
    assert report["device"] == "cpu" and report["environment"]["gpu"] is None
    for key in ("torch", "transformers", "sentence_transformers"):
        assert report["environment"][key]
    assert {"minilm", "bert_base"} <= set(report["models"]) and "RANDOM" in report["models"]["bert_base"]["weights"]
    assert {"reference_float32", "float32_eager", "bfloat16_eager"} <= set(report["engines"])
    assert all(row["startup_s"] > 0 for row in report["engines"].values())
    assert report["duration_s"] > 0
    if importlib.util.find_spec("matplotlib"):
        assert (out / "gpu.png").stat().st_size > 0


def test_correctness_rows_are_sane(results):
    correctness = results[0]["correctness"]
    assert set(correctness["modes"]) == {"float32_eager", "bfloat16_eager", "float32_packed"}  # graphs: CUDA only
    fp32, bf16 = correctness["modes"]["float32_eager"], correctness["modes"]["bfloat16_eager"]
    assert fp32["min_cosine"] > 0.99999 and fp32["nan_rows"] == 0  # padded batches equal one text at a time
    packed = correctness["modes"]["float32_packed"]
    assert packed["min_cosine"] > 0.9999 and packed["nan_rows"] == 0
    assert results[0]["engines"]["float32_packed"]["layout"] == "packed"
    assert results[0]["packed"]["packed"]["real_over_computed_tokens"] == 1.0
    assert 0.99 < bf16["min_cosine"] <= bf16["mean_cosine"] <= 1.0 and bf16["nan_rows"] == 0
    cases = correctness["adversarial"]
    assert set(cases) == {"one_row_in_large_bucket", "lengths_2_and_256_in_one_pass", "small_large_small_replays",
                          "distinct_inputs"}
    both_lengths = cases["lengths_2_and_256_in_one_pass"]
    assert both_lengths["tokens"][0] == 2 and both_lengths["modes"]["float32_eager"]["passes"] == 1
    for case in cases.values():
        assert case["modes"]["float32_eager"]["min_cosine"] > 0.99999
    assert cases["small_large_small_replays"]["modes"]["float32_eager"]["repeat_max_abs_diff"] < 1e-6
    assert cases["distinct_inputs"]["modes"]["float32_eager"]["max_pairwise_cosine"] < 0.9999


def test_speed_rows_and_targets(results):
    report = results[0]
    assert [row["tokens"] for row in report["latency"]] == [16, 64, 128]
    assert all(row["wall_ms"] > 0 and row["event_ms"] is None for row in report["latency"])
    for model in report["saturation"].values():
        assert model["engine"]["tokens_per_s"] > 0 and 0 < model["engine"]["padding_efficiency"] <= 1
        assert set(model["sentence_transformers"]["by_batch_size"]) == {"32", "256"}
        assert 0 < model["mfu"] < 1
    assert report["saturation"]["minilm"]["sentence_transformers_vs_reference"]["min_cosine"] > 0.9999
    [handled] = report["handle"].values()
    assert handled["statuses"] == {"200": report["plan"]["saturation_texts"]}
    assert {"prepare", "model", "encode"} <= set(handled["ms_per_batch"]) and handled["host_over_model"] > 0
    targets = {row["target"]: row for row in report["targets"]}
    assert len(targets) == 9
    assert all(set(row) == {"target", "measured", "goal", "met", "applicable"} for row in targets.values())
    applicable = [row for row in targets.values() if row["applicable"]]
    # Cosine, NaN and packed passes' real / computed tokens hold on CPU too.
    assert len(applicable) == 3 and all(row["met"] for row in applicable)
    assert all(row["met"] is None for row in targets.values() if not row["applicable"])


def test_targets_of_a_cuda_report(results, tmp_path):
    """The GPU-only targets, on the CPU report reshaped as a CUDA run's: graphs rows beside eager."""
    report = copy.deepcopy(results[0])
    report["device"] = "cuda"
    good = {"min_cosine": 0.9995, "mean_cosine": 0.9999, "max_abs_diff": 0.01, "nan_rows": 0}
    graphs = {**good, "graph_replays": 2, "vs_eager": {**good, "min_cosine": 0.99999}}
    report["correctness"]["modes"] = {"float16_eager": good, "float16_graphs": graphs, "bfloat16_eager": good}
    for case in report["correctness"]["adversarial"].values():
        case["modes"] = {"float16_eager": good, "float16_graphs": graphs}
    report["latency"] += [{**row, "mode": "graphs", "wall_ms": row["wall_ms"] * 0.4} for row in report["latency"]]
    for model in report["saturation"].values():
        model["dtype"] = "float16"
    report["handle"] = {"float16_eager": report["handle"]["float32_eager"]}
    # Packed passes eager and replayed from graphs over total tokens, whose padding counts.
    report["packed"]["packed_graphs"] = {"real_tokens_per_s": 1.0, "real_over_computed_tokens": 0.985,
                                         "over_float16_eager": 2.0, "over_float16_graphs": 1.7}
    report["engines"]["float16_packed_graphs"] = {"startup_s": 2.0, "graphs_captured": 278}

    targets = check_targets(report)
    assert all(row["applicable"] and isinstance(row["met"], bool) for row in targets)
    cosine, nan, graphs_equal, latency = targets[:4]
    assert cosine["met"] and nan["met"] and graphs_equal["met"]
    assert latency["measured"] == 0.4 and latency["met"]
    real_over_computed, packed_speedup = targets[-2:]
    assert real_over_computed["measured"] == 0.985 and not real_over_computed["met"]
    assert packed_speedup["measured"] == 1.7 and packed_speedup["met"]
    report["engines"]["float16_packed_graphs"]["graphs_captured"] = 0  # packed ran eagerly: not the target
    assert not check_targets(report)[-1]["met"]
    report["engines"]["float16_packed_graphs"]["graphs_captured"] = 278

    report["correctness"]["adversarial"]["distinct_inputs"]["modes"]["float16_graphs"]["graph_replays"] = 0
    assert not check_targets(report)[2]["met"]  # a case that never replayed proves nothing about graphs
    if importlib.util.find_spec("matplotlib"):
        plot(report, tmp_path / "gpu.png")
        assert (tmp_path / "gpu.png").stat().st_size > 0


def test_compare_counts_non_finite_rows():
    reference = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    vectors = np.array([[2.0, 0.0], [np.nan, 1.0], [1.0, 1.0]])
    assert compare(vectors, reference) == {"min_cosine": 1.0, "mean_cosine": 1.0, "max_abs_diff": 0.0, "nan_rows": 1}


def test_fp16_copy_halves_the_weights(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    copy = write_fp16_copy(tiny_model_dir, tmp_path / "fp16")
    with safe_open(str(copy / "model.safetensors"), "pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"F16"}
    assert (copy / "tokenizer.json").is_file() and (copy / "1_Pooling" / "config.json").is_file()
    original, half = (folder / "model.safetensors" for folder in (tiny_model_dir, copy))
    assert half.stat().st_size < 0.6 * original.stat().st_size
