"""`embedserve batch` against the service it drives: is the command the bottleneck?

    python -m bench.batch [--seconds 10] [--out bench/results/batch.json]

One fresh float32 build of the default model (bench/serving.py: warmed up), the benchmark's
mixed corpus (4-256 tokens). First the service's best texts/s with the benchmark's closed-loop
load generator (bench/load.py) over several shapes, clients x texts per request; then the
command on the same texts, as a user runs it (a subprocess, default settings): a Parquet table
in, Parquet out, against the service's best shape, and an OpenAI batch file of one text a line
against the service at 64 clients of one text a request. Rounds run each in turn, and the median
of the rounds' ratios is kept: the machine is shared and its speed drifts between minutes. Its rows/s is taken from the command's own
summary (from its first request to its last row written; reading the input and /info aside).
The client and the server share the machine's cores, as in every benchmark here.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embedserve.archive.corpus import load_tokenizer, mixed_corpus
from embedserve.archive.default_model import fetch_default_model
from bench.load import run_load
from bench.serving import serve_build

REPO = Path(__file__).resolve().parent.parent
# (clients, texts per request) the service is measured at; the best is the bar.
SHAPES = [(64, 1), (16, 32), (64, 32), (8, 128)]
ROUNDS = 3
TARGET = 0.9


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def run_command(base: str, key: str, source: Path, output: Path, *extra: str) -> dict:
    output.unlink(missing_ok=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "embedserve.batch", str(source), str(output), "--url", base,
                           "--model", "minilm", "--key", key, "--progress", "none", "--restart", *extra],
                          capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"embedserve batch failed:\n{done.stderr}")
    summary = done.stderr.strip().splitlines()[-1]
    rows, seconds = re.search(r"this run (\d+) rows in ([\d.]+) s", summary).groups()
    return {"rows": int(rows), "seconds": float(seconds), "rows_per_s": round(int(rows) / float(seconds), 1),
            "process_wall_s": round(wall, 1), "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per load run")
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "batch.json")
    args = parser.parse_args(argv)

    import pyarrow as pa
    import pyarrow.parquet as pq

    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    texts = mixed_corpus(model_dir / "tokenizer.json", args.texts)
    corpora, tokens = {"mixed": texts}, {"mixed": [len(tokenizer.encode(t).ids) for t in texts]}
    results: dict = {"cpu": cpu_model(), "python": platform.python_version(), "texts": len(texts),
                     "corpus": "bench's mixed corpus (4-256 tokens), all-MiniLM-L6-v2 float32, 2 workers",
                     "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp, \
            serve_build("float32", corpora, tokens, {64, 1}) as (url, auth):
        base = url.split("/predictions/")[0]
        key = auth["Authorization"].removeprefix("Bearer ")
        table, batch_file = Path(tmp) / "texts.parquet", Path(tmp) / "requests.jsonl"
        pq.write_table(pa.table({"text": texts}), table)
        batch_file.write_text("".join(json.dumps({"custom_id": f"t{i}", "method": "POST", "url": "/v1/embeddings",
                                                  "body": {"model": "minilm", "input": t}}) + "\n"
                                      for i, t in enumerate(texts)))

        def load(clients: int, per_request: int) -> dict:
            print(f"service: {clients} clients x {per_request} texts/request ...", file=sys.stderr)
            return run_load(url, auth, texts, tokens["mixed"], concurrency=clients, texts_per_request=per_request,
                            seconds=args.seconds).summary()

        service = [load(c, n) for c, n in SHAPES]
        best = max(service, key=lambda r: r["texts_per_s"])
        best_shape = (best["concurrency"], best["texts_per_request"])
        rounds = []
        for round_ in range(ROUNDS):
            # in turns, so that each ratio compares runs seconds apart on a machine whose speed drifts
            print(f"round {round_ + 1}: the service at its best shape, then the command ...", file=sys.stderr)
            service_best = load(*best_shape)["texts_per_s"]
            table_run = run_command(base, key, table, Path(tmp) / "out.parquet")
            service_one = load(64, 1)["texts_per_s"]
            line_run = run_command(base, key, batch_file, Path(tmp) / "out.jsonl")
            rounds.append({"service_best_texts_per_s": service_best, "batch_table": table_run,
                           "table_of_service_best": round(table_run["rows_per_s"] / service_best, 3),
                           "service_64_clients_1_text_texts_per_s": service_one, "batch_file": line_run,
                           "file_of_service_one_text": round(line_run["rows_per_s"] / service_one, 3)})

    table_ratio = statistics.median(r["table_of_service_best"] for r in rounds)
    results.update({
        "service_shapes": service,
        "service_best_shape": {"concurrency": best_shape[0], "texts_per_request": best_shape[1]},
        "rounds": rounds,
        "median": {
            "service_best_texts_per_s": statistics.median(r["service_best_texts_per_s"] for r in rounds),
            "batch_table_rows_per_s": statistics.median(r["batch_table"]["rows_per_s"] for r in rounds),
            "table_of_service_best": table_ratio,
            "service_64_clients_1_text_texts_per_s": statistics.median(
                r["service_64_clients_1_text_texts_per_s"] for r in rounds),
            "batch_file_rows_per_s": statistics.median(r["batch_file"]["rows_per_s"] for r in rounds),
            "file_of_service_one_text": statistics.median(r["file_of_service_one_text"] for r in rounds),
        },
        "target": {"what": f"table rows/s >= {TARGET} x the service's best texts/s (median of the rounds' ratios)",
                   "met": table_ratio >= TARGET},
    })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("cpu", "service_best_shape", "median", "target")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
