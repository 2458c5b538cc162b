"""Every command of the README and docs/*.md runs as written against a real server, so the docs
cannot rot (the convention and its exceptions: tests/support/doc_commands.py, docs/testing.md).

The server starts the way the README says: its `make serve` line, in a fresh copy of the
repository whose config.properties listens on free loopback ports. Each doc's shell blocks then
run in one bash session there; every curl call must get a 2xx answer that is real (vectors of the
right count and dimension, tokens, the model's /info, an OpenAPI document), every other command
must exit 0. The python blocks run afterwards, and the embeddings they get are checked the same way.
At the end the README's `make stop` stops the server."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import struct
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from embedserve.scripts.serverctl import TorchServe, isolated_config
from tests.support import REPO
from tests.support.doc_commands import (DOCS, SHELL_PRELUDE, Call, blocks, calls, fresh_copy, runnable, shell_script,
                                        substitute)
from tests.support.serving import build, environment
from tests.support.rerankers import make_reranker
from tests.support.image_models import make_clip
from tests.support.m3_models import make_m3
from tests.support.multi_vector_models import make_colbert
from tests.support.page_models import make_colpali
from tests.support.sparse_models import make_splade
from tests.support.tiny_model import make_tiny_model

pytestmark = pytest.mark.integration

DOCS_WITH_COMMANDS = [doc for doc in DOCS if runnable(doc)]


class Served:
    def __init__(self, root: Path, model_dir: Path, serve_output: str):
        self.root = root
        self.model_dir = model_dir
        self.serve_output = serve_output
        self.server = TorchServe(root / "config.properties", root)
        self.ports = {api: urlsplit(self.server.url(api)).port for api in ("inference", "management", "metrics")}

    def key(self) -> str:
        return self.server.keys()["inference"]  # read each time: some docs rotate it

    def dimension(self, model: str) -> int:
        info = requests.get(f"{self.server.url('inference')}/predictions/{model}/1.0/info", headers=self.server.auth(),
                            timeout=30).json()
        return info["embedding_dimension"]


def _serve_line() -> str:
    """The README's `make serve` line, its comment dropped."""
    readme = [b for b in blocks(REPO / "README.md") if re.search(r"(?m)^make serve", b.text)]
    assert readme, "README.md has no block that starts with `make serve`"
    line = next(line for line in readme[0].text.splitlines() if line.startswith("make serve"))
    return line.split("#", 1)[0].strip()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = fresh_copy(tmp_path_factory.mktemp("docs-commands"))
    # The repository's config.properties on free loopback ports, its model store as written.
    isolated_config(root, root / "config.properties", model_store="model_store")
    # make serve would otherwise reinstall the shared .venv from this copy.
    stale = subprocess.run(["make", "-q", ".venv/.installed"], cwd=root).returncode
    assert stale == 0, "the environment is older than setup.cfg or pyproject.toml: run `make serve` first"
    # `make serve` builds the default model as `./build_mar.sh` does unless its archive is newer than
    # the code: the suite's build of it (the same arguments, none) stands in, made once a session.
    mar = build(root / "config.properties")
    os.utime(mar)
    assert subprocess.run(["make", "-q", "model_store/minilm.mar"], cwd=root).returncode == 0
    model_dir = make_tiny_model(tmp_path_factory.mktemp("placeholder") / "hf-model-folder")
    make_reranker("bert", model_dir.parent / "cross-encoder-folder")  # the README's reranker placeholder
    make_splade(model_dir.parent / "splade-folder")  # docs/models.md's sparse model placeholder
    make_m3(model_dir.parent / "bge-m3-folder")  # docs/models.md's hybrid model placeholder
    make_colbert(model_dir.parent / "colbert-folder")  # docs/models.md's multi-vector placeholder
    make_clip(model_dir.parent / "clip-folder")  # docs/models.md's image-text placeholder
    make_colpali(model_dir.parent / "colpali-folder")  # docs/models.md's page retriever placeholder
    started = subprocess.run(_serve_line(), shell=True, cwd=root, capture_output=True, text=True, timeout=900)
    served = Served(root, model_dir, started.stdout)
    try:
        assert started.returncode == 0, f"`make serve` failed:\n{started.stdout[-3000:]}\n{started.stderr[-3000:]}"
        yield served
    finally:
        stopped = subprocess.run(["make", "stop"], cwd=root, capture_output=True, text=True, timeout=120)
        served.server.stop()  # in case `make stop` did not
        assert stopped.returncode == 0 and "TorchServe stopped" in stopped.stdout, stopped.stdout + stopped.stderr


def test_the_commands_make_serve_prints_work_as_pasted(served, tmp_path):
    """`make serve` ends with a curl call and an OpenAI-client snippet; they run as printed
    (with the environment's python, as after `. .venv/bin/activate`). It runs first: the printed
    key stops working once a doc rotates the keys."""
    text = served.serve_output.split("answers real embeddings.", 1)[1].split("\nKeys:", 1)[0]
    assert "curl" in text and "OpenAI(" in text, served.serve_output
    folder = tmp_path / "calls"
    folder.mkdir()
    env = {**os.environ, "DOC_CALLS": str(folder), "PATH": f"{served.root / '.venv' / 'bin'}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", SHELL_PRELUDE + text], cwd=served.root, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    [call] = calls(folder)
    assert not check_call(served, call)
    printed = result.stdout[len(call.answer.decode()):]  # curl's answer ends without a newline
    first_values = json.loads(printed)  # the snippet prints a vector's first 4 values
    assert len(first_values) == 4 and all(math.isfinite(x) for x in first_values), result.stdout


@pytest.mark.parametrize("doc", DOCS_WITH_COMMANDS, ids=[str(d.relative_to(REPO)) for d in DOCS_WITH_COMMANDS])
def test_the_docs_commands_run_as_written(served, doc, tmp_path):
    doc_blocks = runnable(doc)
    shell = [b for b in doc_blocks if b.language != "python"]
    if shell:
        folder = tmp_path / "calls"
        folder.mkdir()
        key = served.key()
        env = {**os.environ, "DOC_CALLS": str(folder), "KEY": key}  # KEY as the README exports it
        script = shell_script(shell, served.ports, served.model_dir)
        # docs/models.md builds and serves a model of each kind (sparse, hybrid, multi-vector): minutes.
        result = subprocess.run(["bash", "-c", script], cwd=served.root, env=env, capture_output=True, text=True,
                                timeout=900)
        assert result.returncode == 0, f"a command of {doc.name} failed:\n{result.stderr[-4000:]}"
        made = calls(folder)
        written = sum(len(re.findall(r"(?m)^\s*(?:[A-Z]+=\S+\s+)?curl\b", b.text)) for b in shell)
        assert len(made) >= written, f"{written} curl lines in {doc.name}, {len(made)} calls made"
        problems = [problem for call in made for problem in check_call(served, call)]
        assert not problems, "\n".join(problems)
        if any("/token?type=inference" in call.url for call in made):  # the docs say the new key is in the file
            assert served.key() != key, f"{doc.name} rotates the inference key, but key_file.json holds the old one"
    for block in (b for b in doc_blocks if b.language == "python"):
        namespace: dict = {"__name__": "__doc_block__"}
        with environment({"KEY": served.key()}):  # as the README exports it
            exec(compile(substitute(block.text, served.ports, served.model_dir), str(block), "exec"), namespace)
        problems = [f"{block}: {problem}" for value in namespace.values() if _is_embeddings(value)
                    for problem in check_client_embeddings(served, value)]
        assert not problems, "\n".join(problems)


# What each answer must hold, by route. A route without a check here (a new one) must still
# answer 2xx, and JSON where it is under /predictions.

def check_call(served: Served, call: Call) -> list[str]:
    if not call.url:
        return []  # no request (curl --help, --version)
    url = urlsplit(call.url)
    where = f"curl {' '.join(call.args)}"
    if url.port == served.ports["metrics"] or url.path.startswith("/token"):
        return []  # Prometheus text (the doc's grep checks it), and the token API's empty answer
    try:
        answer = json.loads(call.answer)
    except ValueError:
        return [f"{where}: the answer is not JSON: {call.answer[:200]!r}"]
    if url.port == served.ports["management"]:
        return [] if _management_answer_is_real(answer, call) else [f"{where}: {answer!r:.300}"]
    parts = url.path.split("/")[2:]  # after /predictions: model, [version, route...]
    model, route = parts[0], "/".join(parts[2:])
    problem = ROUTE_CHECKS.get(route, lambda *_: None)(served, model, call, answer)
    return [f"{where}: {problem}"] if problem else []


def _management_answer_is_real(answer, call: Call) -> bool:
    if "-X" in call.args:  # scaling
        return isinstance(answer, dict) and "status" in answer
    return isinstance(answer, list) and all(entry.get("workers") for entry in answer)


def _request(call: Call) -> tuple[int, dict]:
    """The number of inputs the call sent, and its JSON options."""
    if call.content_type and call.content_type.startswith("text/plain"):
        return 1, {}
    body = json.loads(call.body or "{}")
    inputs = body.get("input", body.get("inputs"))
    single = isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int))
    return (1 if single else len(inputs)), body


def _check_vectors(served: Served, model: str, call: Call, answer) -> str | None:
    count, body = _request(call)
    if isinstance(answer, dict) and body.get("long_input") == "chunk":  # each item says its windows
        if not all(isinstance(item.get("windows"), int) and item["windows"] >= 1 for item in answer["data"]):
            return f"a chunked answer without each input's windows: {answer!r:.300}"
        answer = {**answer, "data": [{k: v for k, v in item.items() if k != "windows"} for item in answer["data"]]}
    if isinstance(answer, dict) and body.get("long_input") == "late_chunk":  # an item a span, saying where it is
        items, spans = answer["data"], ("input", "tokens", "chars")
        owners = [item.get("input") for item in items]
        if owners != sorted(owners) or set(owners) != set(range(count)) or \
                not all(len(item.get("tokens") or ()) == 2 and "chars" in item for item in items):
            return f"a late chunked answer without each span's input, tokens and chars: {answer!r:.300}"
        answer, count = {**answer, "data": [{k: v for k, v in item.items() if k not in spans} for item in items]}, \
            len(items)
    if isinstance(answer, dict) and any(set(item) - {"object", "index", "embedding"} for item in answer["data"]):
        return _check_hybrid(served, model, call, answer)
    first = answer["data"][0]["embedding"] if isinstance(answer, dict) else answer[0]
    if isinstance(first, list) and first and isinstance(first[0], list):  # a multi-vector model's token vectors
        return _check_token_vectors(served, model, call, answer)
    vectors = [entry["embedding"] for entry in answer["data"]] if isinstance(answer, dict) else answer
    if vectors and isinstance(vectors[0], dict):  # a sparse model's native answer
        return _check_sparse(served, model, call, [dict(zip(v["indices"], v["values"])) if "indices" in v else v
                                                    for v in vectors])
    dims = body.get("dimensions") or served.dimension(model)
    dtype = body.get("output_dtype", "float")
    if len(vectors) != count:
        return f"{len(vectors)} vectors for {count} inputs"
    for vector in vectors:
        if isinstance(vector, str):  # base64: float32 bytes of the values
            raw = base64.b64decode(vector)
            if dtype != "float":
                continue
            vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        expected = dims // 8 if dtype in ("binary", "ubinary") else dims
        if len(vector) != expected or not all(math.isfinite(x) and abs(x) < 256 for x in vector):
            return f"a vector of {len(vector)} values, expected {expected} finite ones: {vector[:6]}"
    return None


HYBRID_FIELDS = {"dense": "embedding", "sparse": "sparse_embedding", "colbert": "colbert_embedding"}


def _check_hybrid(served, model, call, answer) -> str | None:
    """A hybrid model's items: what `outputs` asked for and nothing else, each output checked as
    its own answer is; ColBERT vectors a list of equal-length rows of finite values (base64: float32
    bytes, row after row)."""
    count, body = _request(call)
    outputs = body.get("outputs") or ["dense"]
    outputs = [outputs] if isinstance(outputs, str) else outputs
    items = answer["data"]
    fields = {"object", "index", *(HYBRID_FIELDS[name] for name in outputs)}
    if len(items) != count or any(set(item) != fields for item in items):
        return f"expected {count} items holding {sorted(fields)}: {answer!r:.300}"
    if "dense" in outputs:
        problem = _check_vectors(served, model, call, {"data": [{"embedding": item["embedding"]} for item in items]})
        if problem:
            return problem
    if "sparse" in outputs:
        problem = _check_sparse(served, model, call, [dict(zip(v["indices"], v["values"])) if "indices" in v else v
                                                      for v in (item["sparse_embedding"] for item in items)])
        if problem:
            return problem
    for item in (items if "colbert" in outputs else []):
        rows = item["colbert_embedding"]
        if isinstance(rows, str):
            raw = base64.b64decode(rows)
            if not raw:
                return f"an empty base64 ColBERT matrix: {answer!r:.300}"
            if body.get("output_dtype", "float") != "float":
                continue  # codes: their bytes are what was asked
            rows = [struct.unpack(f"<{len(raw) // 4}f", raw)]
        if not rows or len({len(row) for row in rows}) != 1 or not all(math.isfinite(x) for row in rows for x in row):
            return f"ColBERT vectors not equal-length rows of finite values: {rows!r:.300}"
    return None


def _check_sparse(served, model, call, answer) -> str | None:
    """Per input, its entries ({id or token: weight}, or TEI's [{"index", "value"}]): positive
    finite weights, at most max_active_dims of them where asked."""
    count, body = _request(call)
    rows = [row if isinstance(row, dict) else {entry["index"]: entry["value"] for entry in row} for row in answer]
    limit = body.get("max_active_dims") or served.dimension(model)
    if len(rows) != count or not all(0 < len(row) <= limit for row in rows):
        return f"expected {count} sparse vectors of 1 to {limit} entries: {answer!r:.300}"
    if not all(math.isfinite(w) and w > 0 for row in rows for w in row.values()):
        return f"weights not finite and positive: {answer!r:.300}"
    return None


def _check_tokens(served, model, call, answer) -> str | None:
    count, _ = _request(call)
    if len(answer) != count or not all(tokens and all("id" in t for t in tokens) for tokens in answer):
        return f"expected {count} lists of tokens: {answer!r:.300}"
    return None


def _check_info(served, model, call, answer) -> str | None:
    return None if answer.get("embedding_dimension", 0) > 0 else f"no embedding_dimension: {answer!r:.300}"


def _check_openapi(served, model, call, answer) -> str | None:
    return None if str(answer.get("openapi", "")).startswith("3.1") and answer.get("paths") else "not OpenAPI 3.1"


def _check_ranking(served, model, call, answer) -> str | None:
    """TEI's [{"index", "score"}] or Cohere's and Jina's {"results": [{"index", "relevance_score"}]}:
    each document once at most, finite scores, best first, top_n of them where asked."""
    body = json.loads(call.body or "{}")
    documents = body.get("texts", body.get("documents", []))
    ranked = answer["results"] if isinstance(answer, dict) else answer
    scores = [entry.get("score", entry.get("relevance_score")) for entry in ranked]
    indices = [entry["index"] for entry in ranked]
    expected = min(len(documents), body.get("top_n") or len(documents))
    distinct = len(set(indices)) == len(indices) and set(indices) <= set(range(len(documents)))
    if len(ranked) != expected or not distinct:
        return f"expected {expected} distinct documents of {len(documents)}: {answer!r:.300}"
    if not all(isinstance(x, float) and math.isfinite(x) for x in scores) or scores != sorted(scores, reverse=True):
        return f"scores not finite and best first: {scores}"
    return None


def _check_token_vectors(served, model, call, answer) -> str | None:
    """TEI's /embed_all, or a multi-vector model's native answer: per input, equal-length rows of
    finite values."""
    count, _ = _request(call)
    matrices = [item["embedding"] for item in answer["data"]] if isinstance(answer, dict) else answer
    widths = {len(row) for matrix in matrices for row in matrix}
    if len(matrices) != count or len(widths) != 1 or not all(math.isfinite(x) for m in matrices for r in m for x in r):
        return f"expected {count} matrices of finite token vectors: {answer!r:.300}"
    return None


ROUTE_CHECKS = {
    "": _check_vectors,
    "v1/embeddings": _check_vectors,
    "embed": _check_vectors,
    "embed_sparse": _check_sparse,
    "embed_all": _check_token_vectors,
    "tokenize": _check_tokens,
    "info": _check_info,
    "openapi.json": _check_openapi,
    "rerank": _check_ranking,
    "v1/rerank": _check_ranking,
    "v2/rerank": _check_ranking,
}


def _is_embeddings(value) -> bool:
    return type(value).__name__ == "CreateEmbeddingResponse"


def check_client_embeddings(served: Served, response) -> list[str]:
    dims = {served.dimension(response.model)}
    return [f"item {item.index}: {len(item.embedding)} values, first {item.embedding[:4]}"
            for item in response.data
            if len(item.embedding) not in dims or not all(math.isfinite(x) and abs(x) < 256 for x in item.embedding)]
