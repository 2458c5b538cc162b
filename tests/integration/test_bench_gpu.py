"""`python -m bench.gpu` in CPU mode: the GPU benchmark's every step on a tiny model, as CI runs it."""

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.gpu.correctness import compare
from bench.gpu.engines import PeakMemory
from bench.gpu.models import write_fp16_copy
from bench.gpu.report import check_targets, plot
from tests.support import REPO


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
    # What the machine offers TensorRT: on this one, ONNX Runtime's CPU provider and no TensorRT.
    offer = report["environment"]["tensorrt"]
    assert "CPUExecutionProvider" in offer["onnxruntime_providers"] and offer["onnxruntime"]
    assert {"tensorrt", "torch_tensorrt", "onnxruntime_tensorrt", "onnxruntime_cuda"} <= set(offer)
    assert {"minilm", "bert_base"} <= set(report["models"]) and "RANDOM" in report["models"]["bert_base"]["weights"]
    assert {"reference_float32", "float32_eager", "bfloat16_eager"} <= set(report["engines"])
    assert all(row["startup_s"] > 0 for row in report["engines"].values())
    assert report["duration_s"] > 0 and report["complete"] and "errors" not in report
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
    assert {"parse", "tokenize", "model", "encode"} <= set(handled["ms_per_batch"]) and handled["host_over_model"] > 0
    targets = {row["target"]: row for row in report["targets"]}
    assert len(targets) == 9
    assert all({"target", "measured", "goal", "met", "applicable"} <= set(row) for row in targets.values())
    applicable = [row for row in targets.values() if row["applicable"]]
    # Cosine, NaN and packed passes' real / computed tokens hold on CPU too.
    assert len(applicable) == 3 and all(row["met"] for row in applicable)
    assert all(row["met"] is None for row in targets.values() if not row["applicable"])


def _as_cuda_report(report: dict, vs_eager: dict | None = None) -> dict:
    """The CPU report reshaped as a CUDA run's: graphs rows beside eager, `vs_eager` their
    comparison with eager (a close one unless given)."""
    report = copy.deepcopy(report)
    report["device"] = "cuda"
    good = {"min_cosine": 0.9995, "mean_cosine": 0.9999, "max_abs_diff": 0.01, "max_rel_error": 0.03, "nan_rows": 0}
    vs_eager = vs_eager or {**good, "min_cosine": 0.99999, "max_rel_error": 0.002}
    graphs = {**good, "graph_replays": 2, "vs_eager": vs_eager}
    report["correctness"]["modes"] = {"float16_eager": good, "float16_graphs": graphs, "bfloat16_eager": good}
    for case in report["correctness"]["adversarial"].values():
        case["modes"] = {"float16_eager": good, "float16_graphs": graphs}
    report["latency"] += [{**row, "mode": "graphs", "wall_ms": row["wall_ms"] * 0.4} for row in report["latency"]]
    for model in report["saturation"].values():
        model["dtype"] = "float16"
    # A GPU worker's default engine: packed passes replayed from graphs.
    report["handle"] = {name: report["handle"]["float32_eager"] for name in ("float16_eager", "float16_packed_graphs")}
    report["saturation"]["bert_base_packed_graphs"] = {**report["saturation"]["bert_base"], "mfu": 0.4}
    # Packed passes eager and replayed from graphs over total tokens, whose padding counts.
    report["packed"]["packed_graphs"] = {"real_tokens_per_s": 1.0, "real_over_computed_tokens": 0.985,
                                         "over_float16_eager": 2.0, "over_float16_graphs": 1.7}
    report["engines"]["float16_packed_graphs"] = {"startup_s": 2.0, "graphs_captured": 278}
    return report


def test_targets_of_a_cuda_report(results, tmp_path):
    """The GPU-only targets, on the CPU report reshaped as a CUDA run's."""
    report = _as_cuda_report(results[0])
    targets = check_targets(report)
    assert all(row["applicable"] and isinstance(row["met"], bool) for row in targets)
    cosine, nan, graphs_equal, latency = targets[:4]
    assert cosine["met"] and nan["met"] and graphs_equal["met"]
    assert latency["measured"] == 0.4 and latency["met"]
    mfu, host = targets[5:7]
    assert mfu["measured"] == 0.4 and mfu["met"]  # the served engine's, packed passes with graphs
    assert host["measured"] == report["handle"]["float16_packed_graphs"]["host_over_model"]
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


@pytest.mark.parametrize("error", ["length", "direction"])
def test_graphs_target_fails_a_three_percent_replay_error(results, error):
    """Graphs 3% off eager fail, whether the error changes the vectors' length (which a cosine
    cannot see) or their direction (cosine 0.99955, which a looser cosine bar would pass)."""
    rng = np.random.default_rng(0)
    eager = rng.normal(size=(64, 384))
    if error == "length":
        replayed = eager * 1.03
    else:  # 3% of each row's length, at right angles to it
        noise = rng.normal(size=eager.shape)
        noise -= (noise * eager).sum(1, keepdims=True) / (eager * eager).sum(1, keepdims=True) * eager
        replayed = eager + 0.03 * noise * np.linalg.norm(eager, axis=1, keepdims=True) / np.linalg.norm(
            noise, axis=1, keepdims=True)
    off = compare(replayed, eager)
    assert off["max_rel_error"] == pytest.approx(0.03, rel=1e-3)
    graphs_equal = check_targets(_as_cuda_report(results[0], off))[2]
    assert not graphs_equal["met"] and graphs_equal["measured"]["max_rel_error"] == pytest.approx(0.03, rel=1e-3)
    close = compare(eager * (1 + 1e-3 * rng.normal(size=eager.shape)), eager)  # fp16-sized rounding
    assert check_targets(_as_cuda_report(results[0], close))[2]["met"]


def test_compare_counts_non_finite_rows():
    reference = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    vectors = np.array([[2.0, 0.0], [np.nan, 1.0], [1.0, 1.0]])
    # Same directions, one row twice as long: cosine 1, relative error 1.
    assert compare(vectors, reference) == {"min_cosine": 1.0, "mean_cosine": 1.0, "max_abs_diff": 0.0,
                                           "max_rel_error": 1.0, "nan_rows": 1}


class _Allocator:
    """torch.cuda's peak counter, on the CPU: allocated bytes, and their peak since the last reset."""

    def __init__(self):
        self.allocated = self.peak = 0

    def alloc(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.allocated


def test_peak_memory_survives_the_resets_of_graph_warm_ups():
    """A graph warm-up resets torch's peak counter (to size its bucket): the windows still see
    the peaks before it, each window only its own, and the reset is torch's again afterwards."""
    allocator = _Allocator()
    original = allocator.reset_peak_memory_stats
    with PeakMemory(allocator, modules=(allocator,)) as memory:
        model = memory.open()
        allocator.alloc(100)  # a large transient: the reference pass
        allocator.alloc(-100)
        engine = memory.open()
        allocator.alloc(30)
        allocator.alloc(-20)
        allocator.reset_peak_memory_stats(0)  # a bucket's warm-up, as embedserve/handler/backends/cuda_graphs.py calls it
        allocator.alloc(5)
        assert allocator.max_memory_allocated() == 15  # what a plain read at the end would report
        assert memory.close(engine) == 30
        allocator.alloc(50)
        assert memory.close(model) == 100
        assert memory.close(memory.open()) == 65  # a later window: what is allocated now, at least
    assert allocator.reset_peak_memory_stats == original
    assert PeakMemory(None).open() is None and PeakMemory(None).close(None) is None  # CPU: nothing measured


def test_peak_memory_catches_the_resets_the_handler_makes():
    """The reset the graph warm-up calls is the one PeakMemory replaces, and it is restored."""
    import inspect

    import torch

    from embedserve.handler.backends.cuda_graphs import StaticPass

    assert "torch.cuda.reset_peak_memory_stats(" in inspect.getsource(StaticPass.warm_up)
    original = torch.cuda.reset_peak_memory_stats
    with PeakMemory(torch.cuda) as memory:
        assert torch.cuda.reset_peak_memory_stats == memory._reset
        assert torch.cuda.memory.reset_peak_memory_stats == memory._reset
    assert torch.cuda.reset_peak_memory_stats is original and torch.cuda.memory.reset_peak_memory_stats is original


def test_fp16_copy_halves_the_weights(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    copy = write_fp16_copy(tiny_model_dir, tmp_path / "fp16")
    with safe_open(str(copy / "model.safetensors"), "pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"F16"}
    assert (copy / "tokenizer.json").is_file() and (copy / "1_Pooling" / "config.json").is_file()
    original, half = (folder / "model.safetensors" for folder in (tiny_model_dir, copy))
    assert half.stat().st_size < 0.6 * original.stat().st_size
