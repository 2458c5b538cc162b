"""Texts/s and GPU busy against workers per GPU, from a serving run's worker sweep (and the peer's
figures beside it), for docs/gpu.md.

    python -m bench.plot_workers SERVING_JSON [--peer PEER_JSON] --out workers.png

SERVING_JSON is scripts/gpu_serve.sh's serving.json, run with GPU_SERVE_WORKERS (each shape's row
says its worker count); PEER_JSON is scripts/gpu_peer.sh's peer.json, whose shapes are drawn as
flat lines (the peer has no workers to sweep). One line per shape (clients x texts a request) in
each panel; a run without a GPU has no busy figures, and its right panel says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def sweep(serving: dict) -> dict[tuple[int, int], list[tuple[int, float, float | None]]]:
    """(clients, texts a request) -> [(workers, texts/s, GPU busy % or None)], by workers."""
    lines: dict[tuple[int, int], dict[int, tuple[float, float | None]]] = {}
    for row in serving.get("shapes", []):
        if "texts_per_s" not in row or not row.get("workers"):
            continue
        shape = (row["clients"], row["texts_per_request"])
        best = lines.setdefault(shape, {}).get(row["workers"])
        if best is None or row["texts_per_s"] > best[0]:  # a shape measured twice at one count: its best
            lines[shape][row["workers"]] = (row["texts_per_s"], row.get("gpu_util_mean"))
    return {shape: sorted((workers, *figures) for workers, figures in points.items())
            for shape, points in sorted(lines.items())}


def plot(serving: dict, output: Path, peer: dict | None = None) -> None:
    lines = sweep(serving)
    if not lines:
        raise ValueError("the serving run has no shape with a worker count and texts/s")
    figure, (speed, busy) = plt.subplots(1, 2, figsize=(12, 4.5))
    any_busy = False
    for (clients, per_request), points in lines.items():
        label = f"{clients} clients x {per_request} text{'s' if per_request > 1 else ''}"
        workers = [p[0] for p in points]
        [line] = speed.plot(workers, [p[1] for p in points], marker="o", label=label)
        utilisation = [(w, p[2]) for w, p in zip(workers, points) if p[2] is not None]
        if utilisation:
            any_busy = True
            busy.plot(*zip(*utilisation), marker="o", color=line.get_color(), label=label)
        peer_row = next((r for r in (peer or {}).get("shapes", []) if "texts_per_s" in r
                         and (r["clients"], r["texts_per_request"]) == (clients, per_request)), None)
        if peer_row:
            speed.axhline(peer_row["texts_per_s"], linestyle="--", color=line.get_color(),
                          label=f"{label}, {peer['peer']}")
            if peer_row.get("gpu_util_mean") is not None:
                busy.axhline(peer_row["gpu_util_mean"], linestyle="--", color=line.get_color(),
                             label=f"{label}, {peer['peer']}")
    device = (serving.get("gpu") or {}).get("name") or serving.get("device", "?")
    speed.set(xlabel="workers", ylabel="texts/s", title=f"served texts/s ({device})")
    busy.set(xlabel="workers", ylabel="GPU busy, % (mean)", title="GPU busy")
    if not any_busy:
        busy.text(0.5, 0.5, "no GPU in this run", ha="center", va="center", transform=busy.transAxes)
    for axis in (speed, busy):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.plot_workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("serving", type=Path, help="scripts/gpu_serve.sh's serving.json")
    parser.add_argument("--peer", type=Path, default=None, help="scripts/gpu_peer.sh's peer.json")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    peer = json.loads(args.peer.read_text()) if args.peer else None
    plot(json.loads(args.serving.read_text()), args.out, peer)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
