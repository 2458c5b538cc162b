"""What TorchServe's batching costs at each load: the default build served with several
`max_batch_delay` values, each at 1, 4, 16 and 64 closed-loop clients sending one text per
request, in one run.

    python -m bench.batch_delay [--delays 0 2 10] [--seconds 8] [--out bench/results]

TorchServe's batch aggregator (frontend wlm/Model.pollBatch) blocks for a batch's first
request, then polls the queue for up to `batchSize - 1` more, each poll waiting what is left of
`maxBatchDelay`: a lone request always waits the whole delay. With a delay of 1 ms a batch is
about what is queued when a worker asks, so batches still fill whenever the workers are busy,
which is exactly when batching pays. (0 is not a usable value: TorchServe reads an archive's 0
as "not set" and falls back to config.properties, else to its own default of 100 ms.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from embedserve.archive.build import main as build_main
from embedserve.archive.corpus import fixed_corpus, load_tokenizer, mixed_corpus
from embedserve.archive.default_model import fetch_default_model
from embedserve.archive.ts_config import read_properties
from bench.load import run_load, warm_up
from embedserve.scripts.serverctl import TorchServe, isolated_config

REPO = Path(__file__).resolve().parent.parent
CLIENTS = (1, 4, 16, 64)


def sweep(delays: list[int], seconds: float, corpora: dict[str, list[str]], tokens: dict[str, list[int]],
          clients: tuple[int, ...] = CLIENTS, build_args: tuple[str, ...] = ()) -> list[dict]:
    """One row per (delay, corpus, clients): texts/s and latency percentiles."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-delay-") as tmp:
        root = Path(tmp)
        config = isolated_config(root, REPO / "config.properties", async_logging="true")
        for delay in delays:
            # A build per delay: TorchServe takes maxBatchDelay from the archive's model-config.yaml
            # (config.properties only where the archive's is 0), so only the archive can set it.
            if build_main(["--export-path", str(root / "model_store"), "--config", str(config),
                           "--max-batch-delay", str(delay), "--skip-check", *build_args]) != 0:
                raise SystemExit("building the default archive failed")
            name = next(iter(json.loads(read_properties(config)["models"])))
            server = TorchServe(config, root)
            server.start()
            try:
                server.wait_ready(timeout=600)
                url = f"{server.url('inference')}/predictions/{name}"
                warm_up(url, server.auth(), corpora["mixed"], tokens["mixed"])  # the frontend's JIT, first shapes
                for corpus in corpora:
                    for count in clients:
                        summary = run_load(url, server.auth(), corpora[corpus], tokens[corpus], concurrency=count,
                                           texts_per_request=1, seconds=seconds).summary()
                        rows.append({"max_batch_delay_ms": delay, "corpus": corpus, **summary})
                        print(f"  delay {delay} ms, {corpus}, {count} clients: {summary['texts_per_s']} texts/s, "
                              f"p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms", file=sys.stderr)
                        time.sleep(0.5)
            finally:
                server.stop()
    return rows


def default_corpora(count: int = 2048) -> tuple[dict[str, list[str]], dict[str, list[int]]]:
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    corpora = {"mixed": mixed_corpus(model_dir / "tokenizer.json", count),
               "fixed": fixed_corpus(model_dir / "tokenizer.json", count, 64)}
    return corpora, {name: [len(tokenizer.encode(t).ids) for t in texts] for name, texts in corpora.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.batch_delay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", type=int, nargs="+", default=[1, 4, 10])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=None, help="write batch_delay.json here")
    args = parser.parse_args(argv)
    corpora, tokens = default_corpora()
    rows = sweep(args.delays, args.seconds, corpora, tokens)
    print(json.dumps(rows, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "batch_delay.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
