"""Our figures against the peers measured beside them, as one small SVG for docs/performance.md.

    python -m bench.peers [--results bench/results] [--out docs/img/peers.svg] [--check]

Each bar is one ratio read from one result file: our figure over the peer's, both measured on
the same machine in the same run. The SVG is written by hand, with no plotting library, so the
same files always give the same bytes: tests/unit/test_peers_plot.py redraws it and compares it
with the committed one. --check does the same and exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
OUTPUT = REPO / "docs" / "img" / "peers.svg"


@dataclass(frozen=True)
class Bar:
    machine: str
    what: str  # our figure against the peer's
    ours: float
    peer: float
    unit: str
    source: str  # the result file, relative to bench/results/
    gpu: bool = False

    @property
    def ratio(self) -> float:
        return round(self.ours / self.peer, 2)


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def _cpu(cpu: dict | None, threads: int) -> str:
    if not cpu:
        return f"{threads}-core CPU, model not recorded"
    units = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}.get(cpu.get("bf16_units"), "AVX2 only")
    return f"{cpu['model_name']}, {units}, {threads} cores"


def _row(rows: list[dict], corpus: str, clients: int) -> dict:
    return next(r for r in rows if r["corpus"] == corpus and r["concurrency"] == clients
                and r["texts_per_request"] == 1)


def bars(results: Path = RESULTS) -> list[Bar]:
    found = []

    bf16 = _load(results, "cpu_bf16.json")
    machine = _cpu(bf16["machine"]["cpu"], bf16["machine"]["cpu_threads"])
    served = _row(bf16["served"]["auto"]["end_to_end"], "mixed", 64)["texts_per_s"]
    for peer, key in (("sentence-transformers fp32", "sentence_transformers"),
                      ("sentence-transformers bf16", "sentence_transformers_bf16")):
        found.append(Bar(machine, f"served, 64 clients, against {peer} in-process", served,
                         bf16["in_process"][key]["texts_per_s"], "texts/s", "cpu_bf16.json"))

    for name in ("rerank.json", "rerank-avx2.json"):
        rerank = _load(results, name)
        found.append(Bar(_cpu(rerank["machine"]["cpu"], rerank["machine"]["threads"]),
                         "reranking served, 64 clients, against CrossEncoder.predict",
                         rerank["served"]["by_clients"]["64"]["pairs_per_s"],
                         rerank["in_process_cross_encoder"]["pairs_per_s"], "pairs/s", name))

    bench = _load(results, "bench.json")
    found.append(Bar(_cpu(bench["machine"].get("cpu"), bench["machine"]["cpu_threads"]),
                     "float32 served, 64 clients, against sentence-transformers",
                     _row(bench["end_to_end"]["float32"], "mixed", 64)["texts_per_s"],
                     bench["in_process"]["mixed"]["sentence_transformers"]["texts_per_s"], "texts/s", "bench.json"))

    for run in ("gpu_h100_run1", "gpu_h100_run2"):
        gpu = _load(results, f"{run}/gpu.json")
        minilm = gpu["saturation"]["minilm"]
        ours = minilm["engine"]["texts_per_s_with_tokenizing"]
        for batch in ("32", "256"):
            found.append(Bar(f"{gpu['environment']['gpu']}, run {run[-1]}",
                             f"fp16 in-process, against sentence-transformers at batch {batch}", ours,
                             minilm["sentence_transformers"]["by_batch_size"][batch]["texts_per_s"], "texts/s",
                             f"{run}/gpu.json", gpu=True))
    return found


# Layout, in pixels.
WIDTH, LEFT, PLOT, ROW, TOP = 960, 430, 320, 40, 46
CPU_COLOR, GPU_COLOR = "#4878a8", "#6a9a58"


def _number(value: float) -> str:
    return f"{value:,.1f}"


def render(found: list[Bar]) -> str:
    top = max(6, int(max(bar.ratio for bar in found)) + 1)  # the x axis ends at a whole ratio
    scale = PLOT / top
    height = TOP + ROW * len(found) + 34
    bottom = TOP + ROW * len(found)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           '<text x="10" y="20" font-size="14" font-weight="bold">all-MiniLM-L6-v2: ours / the peer on the same '
           'machine, same run (1 = as fast)</text>',
           '<text x="10" y="36" fill="#555">each bar from one file in bench/results/ (docs/performance.md: '
           'dates and commands)</text>']
    for tick in range(top + 1):
        x = LEFT + tick * scale
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{bottom}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle" fill="#555">{tick}x</text>')
    for index, bar in enumerate(found):
        y = TOP + index * ROW
        color = GPU_COLOR if bar.gpu else CPU_COLOR
        out.append(f'<text x="{LEFT - 8}" y="{y + 16}" text-anchor="end" font-weight="bold">'
                   f'{escape(bar.machine)}</text>')
        out.append(f'<text x="{LEFT - 8}" y="{y + 30}" text-anchor="end" font-size="11" fill="#333">{escape(bar.what)}</text>')
        out.append(f'<rect x="{LEFT}" y="{y + 8}" width="{bar.ratio * scale:.1f}" height="{ROW - 16}" '
                   f'fill="{color}"/>')
        out.append(f'<text x="{LEFT + bar.ratio * scale + 6:.1f}" y="{y + 25}">{bar.ratio:.2f}x '
                   f'({_number(bar.ours)} / {_number(bar.peer)} {bar.unit})</text>')
    one = LEFT + scale
    out.append(f'<line x1="{one:.1f}" y1="{TOP - 4}" x2="{one:.1f}" y2="{bottom}" stroke="black" '
               'stroke-dasharray="4 3"/>')
    out.append(f'<text x="{LEFT + PLOT / 2:.1f}" y="{bottom + 30}" text-anchor="middle" fill="#555">'
               'ours / peer (CPU blue, GPU green)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of result files")
    parser.add_argument("--out", type=Path, default=OUTPUT)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs")
    args = parser.parse_args(argv)
    svg = render(bars(args.results))
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != svg:
            print(f"{args.out} is not what {args.results} gives: run python -m bench.peers", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
