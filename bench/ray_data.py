"""The Ray Data path on two local nodes against the same engine in one process, same cores.

    python -m bench.ray_data [--rows 8192] [--out bench/results/ray_data.json]

A float32 build of the default model (the engine trial then has one choice: the same engine on
both sides), the benchmark's mixed corpus (4-256 tokens) as a Parquet table. In-process: the
archive's embedder (`ArchiveEmbedder`, what each actor runs) with 2 threads on the whole table,
timed from its construction (unpacking, loading, warm-up) to the last vector. Ray: a real cluster
of two nodes on this machine (tests/support/ray_cluster.py: a head and a second node, 2 logical
CPUs each), `python -m embedserve.ray_data` with 2 actors of 1 CPU (one a node, 1 thread each:
the same 2 cores), timed from the command's start to its summary (connecting, starting the
actors, reading, writing). The overhead: Ray's start-up (the command's start to the last actor
ready) and the rest. Both read the same file; their vectors' largest difference is kept (one thread a pass against two:
the same sums in another order).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.batch import cpu_model
from embedserve.archive.build import main as build_main
from embedserve.archive.corpus import mixed_corpus
from embedserve.archive.default_model import fetch_default_model
from embedserve.scripts.serverctl import isolated_config
from tests.support.ray_cluster import RayCluster

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.8
BATCH_ROWS = 256
READY = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) INFO embedserve\.ray_data\.embedder: embedder ready",
                   re.MULTILINE)


def build(root: Path, model_dir: Path) -> Path:
    config = isolated_config(root, REPO / "config.properties")
    if build_main(["--model", str(model_dir), "--name", "minilm", "--dtype", "float32",
                   "--export-path", str(root / "model_store"), "--config", str(config)]) != 0:
        raise SystemExit("building the float32 archive failed")
    return root / "model_store" / "minilm.mar"


def in_process(archive: Path, table: pa.Table) -> tuple[float, pa.Table]:
    from embedserve.ray_data.embedder import ArchiveEmbedder

    started = time.perf_counter()
    embedder = ArchiveEmbedder(str(archive), cpu_threads=2)
    ready = time.perf_counter()
    out = embedder(table)
    done = time.perf_counter()
    return {"seconds": round(done - started, 2), "start_up_s": round(ready - started, 2),
            "rows_per_s": round(table.num_rows / (done - started), 1),
            "steady_rows_per_s": round(table.num_rows / (done - ready), 1)}, out


def on_ray(archive: Path, source: Path, output: Path) -> dict:
    cluster = RayCluster().start()
    try:
        started, wall = time.time(), time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "embedserve.ray_data", str(source), str(output), "--archive",
                               str(archive), "--actors", "2", "--batch-rows", str(BATCH_ROWS)],
                              env={**os.environ, **cluster.env}, cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - wall
        if done.returncode != 0:
            raise SystemExit(f"the Ray job failed:\n{done.stderr[-4000:]}")
        ready = [datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() for stamp in READY.findall(cluster.logs())]
    finally:
        cluster.stop()
    summary = done.stderr.strip().splitlines()[-1]
    count = int(re.search(r"(\d+) rows embedded", summary).group(1))
    start_up = max(ready) - started if ready else None
    return {"seconds": round(seconds, 2), "rows_per_s": round(count / seconds, 1),
            "start_up_s": round(start_up, 2) if start_up else None,
            "steady_rows_per_s": round(count / (seconds - start_up), 1) if start_up else None,
            "actors_ready": len(ready), "summary": summary}


def vectors(table: pa.Table) -> np.ndarray:
    column = table.column("embedding").combine_chunks()
    return column.values.to_numpy().reshape(len(column), -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ray_data.json")
    args = parser.parse_args()
    model_dir = fetch_default_model()
    texts = mixed_corpus(model_dir / "tokenizer.json", args.rows)
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        root = Path(tmp)
        archive = build(root, model_dir)
        table = pa.table({"doc_id": list(range(len(texts))), "text": texts})
        pq.write_table(table, root / "corpus.parquet", row_group_size=1024)
        local, local_out = in_process(archive, table)
        ray = on_ray(archive, root / "corpus.parquet", root / "vectors")
        served = pq.read_table(root / "vectors").sort_by("doc_id")
        # One thread a pass there, two here: the same engine, sums in another order.
        difference = float(np.abs(vectors(served) - vectors(local_out)).max())
    result = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg(), "rows": len(texts),
        "model": "all-MiniLM-L6-v2 float32", "batch_rows": BATCH_ROWS,
        "in_process_2_threads": local, "ray_two_nodes_2_actors_1_thread": ray,
        "ratio": round(ray["rows_per_s"] / local["rows_per_s"], 3),
        "steady_ratio": round(ray["steady_rows_per_s"] / local["steady_rows_per_s"], 3)
        if ray["steady_rows_per_s"] else None,
        "target": TARGET, "max_vector_difference": difference,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
