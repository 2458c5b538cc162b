"""Whether a change kept every answer: the same requests (the bench corpus on every route, with
options, bad bodies and wrong routes; MiniLM padded and packed in torch float32, the test rerankers
and classifier) answered in-process by this tree and by another commit, compared byte for byte.

    python -m bench.same_answers --against edf0bbe

Deterministic engines only (torch float32), so a difference is the code's, not a timing trial's.
Needs the default model in the cache (./build_mar.sh or `make mar` puts it there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def answers(workdir: Path) -> dict[str, list]:
    """This tree's answers (run in a child whose PYTHONPATH picks the tree)."""
    from embedserve.archive.corpus import mixed_corpus
    from embedserve.archive.default_model import fetch_default_model
    from embedserve.handler.assembly import assemble
    from embedserve.handler.settings import Settings
    try:
        from embedserve.handler.api.exchange import RawRequest
    except ImportError:  # before the exchange module
        from embedserve.handler.service import RawRequest
    from tests.support.rerankers import make_reranker

    MINILM = fetch_default_model()
    texts = mixed_corpus(MINILM / "tokenizer.json", 256, seed=3)
    found = {}

    def run(name, service, requests):
        responses = service.handle([RawRequest(json.dumps(body).encode(), "application/json", path)
                                    for path, body in requests])
        for i, ((path, body), response) in enumerate(zip(requests, responses)):
            text = re.sub(rb'"id":"[0-9a-f-]{36}"', b'"id":"-"', response.body)  # Cohere's random answer id
            found[f"{name} {i} {path}"] = [response.status, hashlib.sha256(text).hexdigest(), len(text)]

    for packed in (False, True):
        settings = Settings.from_mapping({"device": "cpu", "cpu_threads": 2, "engine": "torch", "dtype": "float32",
                                          "packed": packed, "cache_entries": 0})
        service = assemble(MINILM, settings, model_name="minilm", cuda_available=False, warm=False)
        requests = [("", {"input": texts[i:i + 32]}) for i in range(0, 256, 32)]
        requests += [("v1/embeddings", {"input": texts[:16], "dimensions": 64, "encoding_format": "base64"}),
                     ("v1/embeddings", {"input": texts[16:40], "output_dtype": "int8"}),
                     ("embed", {"inputs": texts[40:60], "normalize": False, "truncate": True,
                                "truncation_direction": "left"}),
                     ("embed", {"inputs": texts[60:70], "output_dtype": "ubinary", "encoding_format": "base64"}),
                     ("similarity", {"inputs": {"source_sentence": texts[0], "sentences": texts[1:30]}}),
                     ("tokenize", {"inputs": texts[:3]}), ("", {"inputs": texts[70:80]}),
                     ("", {"input": [[101, 2023, 2003, 102], [7592, 2088]]}), ("embed", {"inputs": ""}),
                     ("v1/embeddings", {"input": texts[:2], "dimensions": 9999}),
                     ("rerank", {"query": "a", "texts": ["b"]})]
        run(f"minilm packed={packed}", service, requests)

    for family in ("bert", "xlmr", "classifier", "qwen3"):
        model_dir = workdir / family  # made once, by the first tree: both trees read the same weights
        if not (model_dir / "config.json").is_file():
            make_reranker(family, model_dir)
        service = assemble(model_dir, Settings.from_mapping({"device": "cpu", "cpu_threads": 2, "cache_entries": 0,
                                                             "engine": "torch", "dtype": "float32"}),
                           model_name=family, cuda_available=False, warm=False)
        pairs = [[texts[i], texts[i + 1]] for i in range(0, 40, 2)]
        requests = [("predict", {"inputs": pairs}), ("predict", {"inputs": texts[0]}),
                    ("predict", {"inputs": pairs[0], "raw_scores": True})]
        if family != "classifier":
            requests += [("rerank", {"query": texts[0], "texts": texts[1:20], "return_text": True}),
                         ("v1/rerank", {"query": texts[0], "documents": texts[1:20], "top_n": 5}),
                         ("v2/rerank", {"query": texts[0], "documents": [{"text": t} for t in texts[1:8]],
                                        "return_documents": True})]
        requests += [("", {"input": "x"}), ("rerank", {"query": "", "texts": ["a"]})]
        run(family, service, requests)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the commit to compare with")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # output file, model folder
    args = parser.parse_args()
    if args.child:
        Path(args.child[0]).write_text(json.dumps(answers(Path(args.child[1])), sort_keys=True))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        other = tmp / "other"
        other.mkdir()
        archive = subprocess.run(["git", "archive", args.against], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(other)], input=archive, check=True)
        results = {}
        for name, tree in (("other", other), ("this", REPO)):
            out = tmp / f"{name}.json"
            subprocess.run([sys.executable, str(REPO / "bench" / "same_answers.py"), "--against", args.against,
                            "--child", str(out), str(tmp / "models")], cwd=tree, check=True,
                           env={**os.environ, "PYTHONPATH": str(tree)})
            results[name] = json.loads(out.read_text())
    differ = sorted(key for key in results["this"] if results["this"][key] != results["other"].get(key))
    print(f"{len(results['this']) - len(differ)} of {len(results['this'])} answers identical to {args.against}")
    for key in differ:
        print(f"  differs: {key} (status {results['other'].get(key, ['-'])[0]} -> {results['this'][key][0]})")


if __name__ == "__main__":
    main()
