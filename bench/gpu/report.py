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
# What a GPU worker runs by default (handler settings cuda_graphs and packed: auto).
SERVED_GPU_ENGINE = "float16_packed_graphs"
GRAPHS_MAX_REL_ERROR = 0.01


def check_targets(results: dict) -> list[dict]:
    """Every target evaluated on its own, from whatever sections came back: a value, or None with
    the reason (the sections it needs that failed, or what was missing). A target whose sections
    failed in part is never `met`: the value covers only what ran."""
    cuda = results.get("device") == "cuda"
    eager = mode_name("float16" if cuda else "float32", False)
    graphs = mode_name("float16", True)
    served = SERVED_GPU_ENGINE if cuda else eager
    correctness = ("reference", "engine.", "correctness.")
    return [
        _evaluate(results, "every mode: min cosine to the fp32 reference (corpus; adversarial cases)", ">= 0.999",
                  True, correctness, _min_cosine),
        _evaluate(results, "rows with NaN or inf, every mode and case", "0", True, correctness, _non_finite_rows),
        _evaluate(results, "CUDA graphs equal eager (min cosine; largest error relative to the eager row; every "
                  "adversarial case replayed a graph)",
                  f"min cosine >= {GRAPHS_MIN_COSINE}, max relative error <= {GRAPHS_MAX_REL_ERROR}", cuda,
                  ("reference", f"engine.{eager}", f"engine.{graphs}", "correctness."), _graphs_equal_eager),
        _evaluate(results, "graphs / eager batch-1 latency at 16 tokens (wall)", "<= 0.5", cuda,
                  ("latency", f"engine.{eager}", f"engine.{graphs}"), _latency_ratio),
        _evaluate(results, f"MiniLM in-process / sentence-transformers encode (batch {ST_BATCH_SIZES[0]}), mixed "
                  "corpus, texts/s with tokenizing", ">= 5", cuda, ("saturation.minilm", f"engine.{eager}"),
                  _speedup_over_sentence_transformers),
        _evaluate(results, "BERT-base-sized MFU (datasheet peak), the served engine (on CUDA: packed passes "
                  "replayed from graphs)", ">= 0.35", cuda, ("saturation.bert_base", "peak_flops"), _bert_mfu),
        _evaluate(results, "handler host time (prepare + encode) / model time, TorchServe batches of 32, the "
                  "served engine", "<= 0.15", cuda, (f"handle.{served}", f"engine.{served}"), _host_over_model),
        _evaluate(results, "packed passes: real / computed tokens", ">= 0.99", True, ("packed", "engine."),
                  _packed_real_over_computed),
        _evaluate(results, "packed / padded passes, both with graphs, real tokens/s, TorchServe batches of 32",
                  ">= 1.6", cuda, ("packed", "engine."), _packed_speedup),
    ]


def _evaluate(results: dict, name: str, goal: str, applicable: bool, sections: tuple[str, ...],
              measure: Callable[[dict], tuple]) -> dict:
    """One target's row. `measure(results)` gives (value, met); `sections` are the prefixes of the
    section names whose failure this target's value depends on."""
    row = {"target": name, "measured": None, "goal": goal, "met": None, "applicable": applicable}
    failed = sorted(key for key in results.get("errors", {}) if key.startswith(sections))
    try:
        row["measured"], met = measure(results)
        if applicable:  # elsewhere (CPU mode) the figure is shown, never judged
            row["met"] = bool(met) and not failed
    except (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration) as err:
        row["reason"] = f"no value: {type(err).__name__}: {err}"
    if failed:
        row["reason"] = f"{row.get('reason', 'partial value') }; failed sections: {', '.join(failed)}"
    return row


def _modes_and_cases(results: dict) -> tuple[dict, list[dict]]:
    correctness = results["correctness"]
    cases = [row for case in correctness["adversarial"].values() for row in case["modes"].values()]
    if not correctness["modes"]:
        raise KeyError("no mode's correctness")
    return correctness["modes"], cases


def _min_cosine(results: dict) -> tuple:
    modes, cases = _modes_and_cases(results)
    min_cosine = {name: row["min_cosine"] for name, row in modes.items()}
    adversarial = min((row["min_cosine"] for row in cases if row["min_cosine"] is not None), default=None)
    values = [*min_cosine.values(), adversarial]
    return {**min_cosine, "adversarial": adversarial}, all(v is not None and v >= 0.999 for v in values)


def _non_finite_rows(results: dict) -> tuple:
    modes, cases = _modes_and_cases(results)
    rows = sum(row["nan_rows"] for row in [*modes.values(), *cases])
    return rows, rows == 0


def _graphs_equal_eager(results: dict) -> tuple:
    modes, cases = _modes_and_cases(results)
    vs_eager = [row["vs_eager"] for row in [*modes.values(), *cases] if "vs_eager" in row]
    if not vs_eager:
        raise KeyError("no graphs row compared with eager")
    replays = [row["graph_replays"] for row in cases if "graph_replays" in row]
    cosine = min((row["min_cosine"] for row in vs_eager), key=_worst_first)
    error = max((row.get("max_rel_error") for row in vs_eager), key=_worst_last)
    met = (cosine is not None and cosine >= GRAPHS_MIN_COSINE and error is not None
           and error <= GRAPHS_MAX_REL_ERROR and all(replays))
    return {"min_cosine": cosine, "max_rel_error": error}, met


def _latency_ratio(results: dict) -> tuple:
    wall = {(row["tokens"], row["mode"]): row["wall_ms"] for row in results["latency"]}
    ratio = round(wall[(16, "graphs")] / wall[(16, "eager")], 3)
    return ratio, ratio <= 0.5


def _speedup_over_sentence_transformers(results: dict) -> tuple:
    minilm = results["saturation"]["minilm"]
    st = minilm["sentence_transformers"]["by_batch_size"][str(ST_BATCH_SIZES[0])]["texts_per_s"]
    speedup = round(minilm["engine"]["texts_per_s_with_tokenizing"] / st, 2)
    return speedup, speedup >= 5


def _bert_mfu(results: dict) -> tuple:
    row = "bert_base_packed_graphs" if results["device"] == "cuda" else "bert_base"
    mfu = results["saturation"][row]["mfu"]
    return mfu, mfu >= 0.35


def _host_over_model(results: dict) -> tuple:
    served = SERVED_GPU_ENGINE if results["device"] == "cuda" else mode_name("float32", False)
    value = results["handle"][served]["host_over_model"]
    return value, value <= 0.15


def _packed_real_over_computed(results: dict) -> tuple:
    # On CUDA packed passes replay graphs over total tokens: their padding counts, as the issue asks.
    packed = results["packed"]
    row = packed["packed_graphs"] if results["device"] == "cuda" else packed["packed"]
    value = row["real_over_computed_tokens"]
    return value, value >= 0.99


def _packed_speedup(results: dict) -> tuple:
    speedup = results["packed"]["packed_graphs"][f"over_{mode_name('float16', True)}"]
    replayed = results["engines"].get("float16_packed_graphs", {}).get("graphs_captured", 0) > 0
    return speedup, speedup >= 1.6 and replayed


def _worst_first(value: float | None) -> float:
    """Sort key: None (every row NaN) before any cosine."""
    return float("-inf") if value is None else value


def _worst_last(value: float | None) -> float:
    """Sort key: None (every row NaN, or no such figure) after any error."""
    return float("inf") if value is None else value


def plot(results: dict, output: Path) -> None:
    """Four panels: distance to the reference per mode, batch-1 latency, saturation against
    sentence-transformers, and the handler's time per TorchServe batch. A panel whose section
    did not come back says so and the others are drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, ((accuracy, speed), (throughput, split)) = plt.subplots(2, 2, figsize=(13, 9))
    where = results["environment"].get("gpu") or "CPU"
    figure.suptitle(f"bench.gpu on {where}, {results['environment']['date']}")
    for panel, draw in ((accuracy, _accuracy_panel), (speed, _latency_panel), (throughput, _saturation_panel),
                        (split, _handle_panel)):
        try:
            draw(panel, results)
        except (KeyError, TypeError, ValueError, StopIteration) as err:
            panel.clear()
            panel.text(0.5, 0.5, f"no figures ({type(err).__name__}: {err})", ha="center", va="center",
                       wrap=True, transform=panel.transAxes)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)


def _accuracy_panel(accuracy, results: dict) -> None:
    modes = results["correctness"]["modes"]
    distance = [max(1 - (row["min_cosine"] or 0), 1e-9) for row in modes.values()]
    accuracy.bar(list(modes), distance, color="tab:blue")
    accuracy.axhline(1e-3, color="red", linestyle="--", label="target: min cosine 0.999")
    accuracy.set_yscale("log")
    accuracy.set_title("1 - min cosine to the fp32 reference (lower is better)")
    accuracy.legend(fontsize=8)


def _latency_panel(speed, results: dict) -> None:
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


def _saturation_panel(throughput, results: dict) -> None:
    models = {role: row for role, row in results["saturation"].items() if row.get("sentence_transformers")}
    series = {"engine": [m["engine"]["texts_per_s_with_tokenizing"] for m in models.values()]}
    for size in ST_BATCH_SIZES:
        series[f"sentence-transformers, batch {size}"] = [
            m["sentence_transformers"]["by_batch_size"][str(size)]["texts_per_s"] for m in models.values()]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        bars = throughput.bar(np.arange(len(models)) + i * width, values, width, label=label)
        if label == "engine":
            throughput.bar_label(bars, [f"MFU {m['mfu']:.0%}" if m["mfu"] is not None else "MFU ?"
                                        for m in models.values()], fontsize=8)
    throughput.set_xticks(np.arange(len(models)) + width * (len(series) - 1) / 2,
                          [results["models"][role]["name"] for role in models], fontsize=8)
    throughput.set_ylabel("texts/s (mixed corpus, tokenizing included)")
    throughput.set_title(f"saturation, {next(iter(models.values()))['dtype']}")
    throughput.legend(fontsize=8)


def _handle_panel(split, results: dict) -> None:
    handled = results["handle"]
    if not handled:
        raise KeyError("handle")
    bottom = np.zeros(len(handled))
    for stage in ("parse", "tokenize", "model", "encode"):
        values = np.array([row["ms_per_batch"].get(stage, 0.0) for row in handled.values()])
        split.bar(list(handled), values, bottom=bottom, label=stage)
        bottom += values
    split.set_ylabel(f"ms per TorchServe batch of {TORCHSERVE_BATCH}")
    split.set_title("engine.handle: one-text JSON requests")
    split.legend(fontsize=8)


def write_atomically(path: Path, text: str) -> None:
    """Write beside `path`, then rename: a run killed by its time limit mid-write leaves the
    previous checkpoint whole, never a truncated file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def checkpointer(path: Path, started: float) -> Callable[[dict], None]:
    """A function that rewrites `path` with the results so far (`complete`: false), the targets they
    reach and the seconds since `started`: called after each section, so a run stopped by a time
    limit still leaves what it measured."""
    def checkpoint(results: dict) -> None:
        results["duration_s"] = round(time.perf_counter() - started, 1)
        # The targets too, as far as the figures go: a run stopped here still says what it met.
        results["targets"] = check_targets(results)
        write_atomically(path, json.dumps({**results, "complete": False}, indent=2))

    return checkpoint
