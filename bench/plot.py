"""Plot the end-to-end results: throughput and latency percentiles against concurrency."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def plot(results: dict, output: Path) -> None:
    rows = results["end_to_end"]["float32"]
    series = sorted({(r["corpus"], r["texts_per_request"]) for r in rows})
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    for corpus, per_request in series:
        points = sorted((r for r in rows if (r["corpus"], r["texts_per_request"]) == (corpus, per_request)),
                        key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in points]
        label = f"{corpus}, {per_request} text(s)/request"
        [line] = throughput.plot(x, [r["texts_per_s"] for r in points], marker="o", label=label)
        for percentile, style in (("p50_ms", "-"), ("p99_ms", ":")):
            latency.plot(x, [r[percentile] for r in points], style, marker="o", color=line.get_color(),
                         label=f"{label} {percentile[:3]}")
    unlent = sorted(results["end_to_end"].get("float32_no_lending", []), key=lambda r: r["concurrency"])
    if unlent:
        throughput.plot([r["concurrency"] for r in unlent], [r["texts_per_s"] for r in unlent], "--", marker="x",
                        color="grey", label="mixed, 1 text(s)/request, workers not lending CPUs")
    st = results["in_process"]["mixed"]["sentence_transformers"]["texts_per_s"]
    throughput.axhline(st, color="grey", linestyle="--", label="sentence-transformers in-process (mixed)")
    throughput.axhline(results["matmul"]["fixed_texts_per_s_limit"], color="black", linestyle=":",
                       label="matmul limit (fixed 64 tokens)")
    for axis, title, unit in ((throughput, "throughput", "texts/s"), (latency, "latency", "ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(unit)
        axis.set_title(f"all-MiniLM-L6-v2 through TorchServe: {title}")
        axis.grid(True, alpha=0.3)
    latency.set_yscale("log")
    throughput.legend(fontsize=7)
    latency.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
