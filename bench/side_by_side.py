"""This tree's default build against another revision's, served at once and measured in turns.

    python -m bench.side_by_side --against REV [--new-args "--dtype float32"] [--rounds 3] [--seconds 10] [--out DIR]

Each tree builds its own default archive with its own code (`./build_mar.sh` of a git worktree
at REV, and of this checkout), each is served by a TorchServe of its own (its default workers,
lending on), and both stay up while every shape runs on one, then the other, round after round:
a shared machine drifts over minutes, two servers measured side by side do not. Shapes:
64 clients, one mixed text per request (texts/s); one client, one mixed text and one 64-token
text per request (p50 and p99 ms). Writes DIR/side_by_side.json and prints the table.
`--new-args` builds this checkout with build_mar.sh options (e.g. `--dtype float32`, the path a
CPU without bf16 units serves), to compare one path of this tree with the other's default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import requests

from bench.load import WARMUP_SECONDS, run_load, warm_up
from embedserve.archive.corpus import fixed_corpus, load_tokenizer, mixed_corpus
from embedserve.archive.default_model import fetch_default_model
from embedserve.scripts.serverctl import TorchServe, isolated_config

REPO = Path(__file__).resolve().parent.parent
FIXED_LENGTH = 64
# (corpus, clients): the rows of docs/performance.md the comparison is about.
SHAPES = (("mixed", 64), ("mixed", 1), ("fixed", 1))


@contextmanager
def served(tree: Path, root: Path, build_args: list[str] = ()):
    """A TorchServe of its own serving `tree`'s default build, built by that tree's own code:
    (predictions URL, auth headers)."""
    root.mkdir(parents=True, exist_ok=True)
    config = isolated_config(root, tree / "config.properties", async_logging="true")
    subprocess.run([str(tree / "build_mar.sh"), *build_args, "--export-path", str(root / "model_store"),
                    "--config", str(config)],
                   check=True, env={**os.environ, "PYTHON": sys.executable}, stdout=sys.stderr,
                   cwd=tree)  # `python -m` imports from its working directory first
    server = TorchServe(config, root)
    # The workers import `embedserve` from the tree on PYTHONPATH first: without it, an
    # environment with this checkout installed editable would serve this checkout's code for both.
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)
    try:
        server.start()
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = previous
    try:
        server.wait_ready(timeout=600)
        yield f"{server.url('inference')}/predictions/minilm", server.auth()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the git revision to compare this checkout with")
    parser.add_argument("--new-args", default="", help="build_mar.sh options for this checkout's build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)

    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    corpora = {"mixed": mixed_corpus(model_dir / "tokenizer.json", 2048),
               "fixed": fixed_corpus(model_dir / "tokenizer.json", 2048, FIXED_LENGTH)}
    tokens = {name: [len(tokenizer.encode(t).ids) for t in texts] for name, texts in corpora.items()}
    results: dict = {"against": args.against, "new_args": args.new_args, "rounds": args.rounds, "seconds": args.seconds, "runs": []}
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as tmp, ExitStack() as stack:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old_tree), args.against],
                       check=True, stdout=sys.stderr)
        stack.callback(subprocess.run, ["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)])
        servers = {name: stack.enter_context(served(tree, Path(tmp) / name, build_args))
                   for name, tree, build_args in (("old", old_tree, []), ("new", REPO, args.new_args.split()))}
        for name, (url, auth) in servers.items():  # both warm, each while the other idles
            warm_up(url, auth, corpora["mixed"], tokens["mixed"], seconds=WARMUP_SECONDS)
            info = requests.get(f"{url}/1.0/info", headers=auth, timeout=30).json()  # what each build serves
            results.setdefault("served", {})[name] = {key: info.get(key) for key in ("engine", "model_dtype")}
        for round_ in range(args.rounds):
            for corpus, clients in SHAPES:
                for name, (url, auth) in servers.items():
                    print(f"round {round_ + 1}: {name}, {corpus}, {clients} clients ...", file=sys.stderr)
                    run = run_load(url, auth, corpora[corpus], tokens[corpus], concurrency=clients,
                                   texts_per_request=1, seconds=args.seconds).summary()
                    results["runs"].append({"round": round_ + 1, "build": name, "corpus": corpus, **run})
                    time.sleep(1.0)
    results["summary"] = _summary(results["runs"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "side_by_side.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["served"]))
    for row in results["summary"]:
        print(json.dumps(row))
    return 0


def _summary(runs: list[dict]) -> list[dict]:
    """Per shape and build: every round's figure and the median; new / old of the medians."""
    rows = []
    for corpus, clients in SHAPES:
        figure = "texts_per_s" if clients > 1 else "p50_ms"
        per_build = {build: [r[figure] for r in runs if (r["build"], r["corpus"], r["concurrency"]) ==
                             (build, corpus, clients)] for build in ("old", "new")}
        medians = {build: statistics.median(values) for build, values in per_build.items()}
        row = {"corpus": corpus, "clients": clients, "figure": figure, "rounds": per_build, "median": medians,
               "new_over_old": round(medians["new"] / medians["old"], 3)}
        if clients == 1:
            row["p99_ms"] = {build: [r["p99_ms"] for r in runs if (r["build"], r["corpus"], r["concurrency"]) ==
                                     (build, corpus, clients)] for build in ("old", "new")}
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
