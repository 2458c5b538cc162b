"""gpu.json and gpu.png: the file rewritten after each section, the targets checked on the
figures, and the plot drawn from them (or from a gpu.json alone: --replot). It reads results,
never runs a step, so it imports none of them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from bench.gpu.common import ST_BATCH_SIZES, TORCHSERVE_BATCH, mode_name

# Graphs against the same passes run eagerly: the cosine, blind to a change of length, and the
# largest distance between two rows relative to the eager row's length (embedserve/handler/backends/cuda_graphs.py's
# measure), which a 3% replay error fails whatever its direction.
GRAPHS_MIN_COSINE = 0.9999
GRAPHS_MAX_REL_ERROR = 0.01


def check_targets(results: dict) -> list[dict]:
    cuda = results["device"] == "cuda"
    correctness = results["correctness"]
    modes = correctness["modes"]
    adversarial_rows = [row for case in correctness["adversarial"].values() for row in case["modes"].values()]
    min_cosine = {name: row["min_cosine"] for name, row in modes.items()}
    adversarial_min = min((row["min_cosine"] for row in adversarial_rows if row["min_cosine"] is not None),
                          default=None)
    nan_rows = sum(row["nan_rows"] for row in [*modes.values(), *adversarial_rows])
    graph_vs_eager = [row["vs_eager"] for row in [*modes.values(), *adversarial_rows] if "vs_eager" in row]
    replays = [row["graph_replays"] for row in adversarial_rows if "graph_replays" in row]
    graphs_cosine = min((row["min_cosine"] for row in graph_vs_eager), key=_worst_first, default=None)
    graphs_error = max((row.get("max_rel_error") for row in graph_vs_eager), key=_worst_last, default=None)
    graphs_equal = None if not graph_vs_eager else {"min_cosine": graphs_cosine, "max_rel_error": graphs_error}
    graphs_met = (graphs_cosine is not None and graphs_cosine >= GRAPHS_MIN_COSINE and graphs_error is not None
                  and graphs_error <= GRAPHS_MAX_REL_ERROR and all(replays))
    latency = {(row["tokens"], row["mode"]): row["wall_ms"] for row in results["latency"]}
    latency_ratio = latency[(16, "graphs")] / latency[(16, "eager")] if (16, "graphs") in latency else None
    minilm, bert = results["saturation"]["minilm"], results["saturation"]["bert_base"]
    st = minilm["sentence_transformers"]["by_batch_size"][str(ST_BATCH_SIZES[0])]["texts_per_s"]
    speedup = minilm["engine"]["texts_per_s_with_tokenizing"] / st
    host = results["handle"][mode_name(minilm["dtype"], False)].get("host_over_model")
    # On CUDA packed passes replay graphs over total tokens: their padding counts, as the issue asks.
    packed = results["packed"].get("packed_graphs") or results["packed"]["packed"]
    packed_speedup = results["packed"].get("packed_graphs", {}).get(f"over_{mode_name('float16', True)}")
    packed_replayed = results["engines"].get("float16_packed_graphs", {}).get("graphs_captured", 0) > 0
    return [
        _target("every mode: min cosine to the fp32 reference (corpus; adversarial cases)",
                {**min_cosine, "adversarial": adversarial_min}, ">= 0.999",
                all(v is not None and v >= 0.999 for v in [*min_cosine.values(), adversarial_min])),
        _target("rows with NaN or inf, every mode and case", nan_rows, "0", nan_rows == 0),
        _target("CUDA graphs equal eager (min cosine; largest error relative to the eager row; every adversarial "
                "case replayed a graph)", graphs_equal,
                f"min cosine >= {GRAPHS_MIN_COSINE}, max relative error <= {GRAPHS_MAX_REL_ERROR}", graphs_met, cuda),
        _target("graphs / eager batch-1 latency at 16 tokens (wall)", _round(latency_ratio), "<= 0.5",
                latency_ratio is not None and latency_ratio <= 0.5, cuda),
        _target(f"MiniLM in-process / sentence-transformers encode (batch {ST_BATCH_SIZES[0]}), mixed corpus, "
                "texts/s with tokenizing", round(speedup, 2), ">= 5", speedup >= 5, cuda),
        _target("BERT-base-sized MFU (datasheet peak)", bert["mfu"], ">= 0.35", bert["mfu"] >= 0.35, cuda),
        _target("handler host time (prepare + encode) / model time, TorchServe batches of 32",
                host, "<= 0.15", host is not None and host <= 0.15, cuda),
        _target("packed passes: real / computed tokens", packed["real_over_computed_tokens"], ">= 0.99",
                packed["real_over_computed_tokens"] >= 0.99),
        _target("packed / padded passes, both with graphs, real tokens/s, TorchServe batches of 32",
                packed_speedup, ">= 1.6", packed_speedup is not None and packed_speedup >= 1.6 and packed_replayed,
                cuda),
    ]


def _worst_first(value: float | None) -> float:
    """Sort key: None (every row NaN) before any cosine."""
    return float("-inf") if value is None else value


def _worst_last(value: float | None) -> float:
    """Sort key: None (every row NaN, or no such figure) after any error."""
    return float("inf") if value is None else value


def _target(name: str, measured, goal: str, met: bool, applicable: bool = True) -> dict:
    return {"target": name, "measured": measured, "goal": goal, "met": bool(met) if applicable else None,
            "applicable": applicable}


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def plot(results: dict, output: Path) -> None:
    """Four panels: distance to the reference per mode, batch-1 latency, saturation against
    sentence-transformers, and the handler's time per TorchServe batch."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, ((accuracy, speed), (throughput, split)) = plt.subplots(2, 2, figsize=(13, 9))
    where = results["environment"].get("gpu") or "CPU"
    figure.suptitle(f"bench.gpu on {where}, {results['environment']['date']}")

    modes = results["correctness"]["modes"]
    distance = [max(1 - (row["min_cosine"] or 0), 1e-9) for row in modes.values()]
    accuracy.bar(list(modes), distance, color="tab:blue")
    accuracy.axhline(1e-3, color="red", linestyle="--", label="target: min cosine 0.999")
    accuracy.set_yscale("log")
    accuracy.set_title("1 - min cosine to the fp32 reference (lower is better)")
    accuracy.legend(fontsize=8)

    rows = results["latency"]
    lengths = sorted({row["tokens"] for row in rows})
    names = list(dict.fromkeys(row["mode"] for row in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next(r["wall_ms"] for r in rows if (r["tokens"], r["mode"]) == (n, name)) for n in lengths]
        speed.bar(np.arange(len(lengths)) + i * width, values, width, label=name)
    speed.set_xticks(np.arange(len(lengths)) + width * (len(names) - 1) / 2, [f"{n} tokens" for n in lengths])
    speed.set_ylabel("ms (median, wall)")
    speed.set_title("batch-1 latency of encoder.embed")
    speed.legend(fontsize=8)

    models = results["saturation"]
    series = {"engine": [m["engine"]["texts_per_s_with_tokenizing"] for m in models.values()]}
    for size in ST_BATCH_SIZES:
        series[f"sentence-transformers, batch {size}"] = [
            m["sentence_transformers"]["by_batch_size"][str(size)]["texts_per_s"] for m in models.values()]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        bars = throughput.bar(np.arange(len(models)) + i * width, values, width, label=label)
        if label == "engine":
            throughput.bar_label(bars, [f"MFU {m['mfu']:.0%}" for m in models.values()], fontsize=8)
    throughput.set_xticks(np.arange(len(models)) + width * (len(series) - 1) / 2,
                          [results["models"][role]["name"] for role in models], fontsize=8)
    throughput.set_ylabel("texts/s (mixed corpus, tokenizing included)")
    throughput.set_title(f"saturation, {next(iter(models.values()))['dtype']}")
    throughput.legend(fontsize=8)

    handled = results["handle"]
    bottom = np.zeros(len(handled))
    for stage in ("prepare", "model", "encode"):
        values = np.array([row["ms_per_batch"].get(stage, 0.0) for row in handled.values()])
        split.bar(list(handled), values, bottom=bottom, label=stage)
        bottom += values
    split.set_ylabel(f"ms per TorchServe batch of {TORCHSERVE_BATCH}")
    split.set_title("engine.handle: one-text JSON requests")
    split.legend(fontsize=8)

    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)


def write_atomically(path: Path, text: str) -> None:
    """Write beside `path`, then rename: a run killed by its time limit mid-write leaves the
    previous checkpoint whole, never a truncated file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def checkpointer(path: Path, started: float) -> Callable[[dict], None]:
    """A function that rewrites `path` with the results so far (`complete`: false) and the seconds
    since `started`: called after each section, so a run stopped by a time limit still leaves
    what it measured."""
    def checkpoint(results: dict) -> None:
        results["duration_s"] = round(time.perf_counter() - started, 1)
        write_atomically(path, json.dumps({**results, "complete": False}, indent=2))

    return checkpoint
