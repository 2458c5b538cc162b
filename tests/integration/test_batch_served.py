"""`embedserve batch` against the real TorchServe of the session (tests/conftest.py: the tiny model,
one worker, batches of 8): batch files and tables in, results in input order out, vectors the
same bytes the service answers for the same request, a bad line failing alone, and a run killed
with SIGKILL that a rerun completes with every row exactly once."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from bench.recovery import model_workers, wait_replaced
from tests.support import REPO
from tests.support.client import predict
from tests.support.inputs import varied_texts

pytestmark = pytest.mark.integration

COMMAND = Path(sys.executable).parent / "embedserve"  # the console script (setup.cfg)


def batch(server, *args, check=True, background=False):
    command = [str(COMMAND), "batch", *map(str, args), "--url", server.url("inference"), "--model", "tiny",
               "--key-file", str(server.workdir / "key_file.json"), "--progress", "log", "--log-every", "1"]
    if background:
        return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert not check or done.returncode == 0, done.stderr
    return done


def request_line(custom_id, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}) + "\n"


def floats(data):
    """An OpenAI answer's vectors as float32 bytes, whatever their encoding."""
    return [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if isinstance(d["embedding"], str)
            else np.array(d["embedding"], np.float32) for d in data]


@pytest.fixture(scope="module")
def st_model(tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(tiny_model_dir), device="cpu")


def test_a_batch_file_gets_the_services_answers_in_order(server, st_model, tmp_path):
    texts = varied_texts(40)
    bodies = [{"model": "tiny", "input": t} for t in texts[:30]]
    bodies += [{"model": "tiny", "input": texts[30:34]}, {"input": texts[34:36], "encoding_format": "base64"},
               {"input": [True]},  # wrong type: the service's 400, and the job goes on
               {"input": texts[36], "dimensions": 16}, {"input": texts[37:40], "prompt_name": "query"}]
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(request_line(f"req-{i}", b) for i, b in enumerate(bodies)))
    done = batch(server, source, tmp_path / "results.jsonl")
    assert "34 succeeded, 1 failed (400: 1)" in done.stderr, done.stderr

    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(len(bodies))]
    assert len({r["id"] for r in results}) == len(results) and all(r["id"].startswith("batch_req_") for r in results)
    bad = results[32]
    assert bad["response"]["status_code"] == 400 and bad["error"] is None
    assert bad["response"]["body"]["error"]["param"] == "input[0]"
    for result, body in zip(results, bodies):
        direct = predict(server, body, path="v1/embeddings")
        assert result["response"]["status_code"] == direct.status_code
        if direct.status_code == 200:
            assert result["error"] is None and result["response"]["request_id"]
            got, expected = floats(result["response"]["body"]["data"]), floats(direct.json()["data"])
            assert [g.tobytes() for g in got] == [e.tobytes() for e in expected]
            assert result["response"]["body"]["usage"] == direct.json()["usage"]

    # close to sentence-transformers on the plain texts
    served = np.stack([floats(r["response"]["body"]["data"])[0] for r in results[:30]])
    reference = st_model.encode(texts[:30], normalize_embeddings=True)
    cosines = np.sum(served * reference, axis=1) / np.linalg.norm(served, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.9999, cosines.min()


def test_a_parquet_table_gets_a_fixed_size_vector_column(server, st_model, tmp_path):
    texts = varied_texts(150, seed=3)
    texts[7], texts[8] = None, ""  # rows the service would refuse: not sent, named in `error`
    ids = [f"doc-{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"doc_id": ids, "body": texts}), tmp_path / "corpus.parquet")
    done = batch(server, tmp_path / "corpus.parquet", tmp_path / "vectors.parquet", "--text-column", "body",
                 "--id-column", "doc_id", "--rows-per-request", "16")
    assert "148 succeeded, 2 failed (not sent: 2)" in done.stderr, done.stderr
    assert not (tmp_path / "vectors.parquet.parts").exists()

    table = pq.read_table(tmp_path / "vectors.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    assert table.column("id").to_pylist() == ids
    vectors, errors = table.column("embedding").to_pylist(), table.column("error").to_pylist()
    assert vectors[7] is None and vectors[8] is None and "no text" in errors[7] and "empty" in errors[8]
    sent = [i for i, t in enumerate(texts) if t]
    direct = predict(server, {"input": [texts[i] for i in sent], "encoding_format": "base64"}, path="v1/embeddings")
    expected = floats(direct.json()["data"])
    assert [np.array(vectors[i], np.float32).tobytes() for i in sent] == [e.tobytes() for e in expected]
    assert all(e is None for i, e in enumerate(errors) if i in sent)
    reference = st_model.encode([texts[i] for i in sent], normalize_embeddings=True)
    assert np.sum(np.stack(expected) * reference, axis=1).min() >= 0.9999

    # the same table as CSV, written as JSONL rows: the same vectors
    with (tmp_path / "corpus.csv").open("w", newline="") as f:
        import csv

        writer = csv.writer(f)
        writer.writerow(["body"])
        writer.writerows([[t or ""] for t in texts])
    batch(server, tmp_path / "corpus.csv", tmp_path / "vectors.jsonl", "--text-column", "body")
    rows = [json.loads(line) for line in (tmp_path / "vectors.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(len(texts)))
    assert [np.array(rows[i]["embedding"], np.float32).tobytes() for i in sent] == [e.tobytes() for e in expected]


def test_a_killed_run_is_completed_by_a_rerun_each_row_once(server, tmp_path):
    count = 600
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("".join(request_line(f"r{i}", {"input": f"text number {i} of the corpus"})
                              for i in range(count)))
    # 8 requests in flight, batches of 8 a worker with a 150 ms delay: the run takes seconds
    running = batch(server, source, output, "--concurrency", "8", background=True)
    deadline = time.monotonic() + 120
    while (not output.exists() or output.read_bytes().count(b"\n") < 100) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(running.pid, signal.SIGKILL)
    running.wait(timeout=30)
    written = output.read_bytes().count(b"\n")
    assert 100 <= written < count, written

    done = batch(server, source, output, "--concurrency", "8")
    assert f"continuing after row {written}" in done.stderr, done.stderr
    assert f"this run {count - written} rows" in done.stderr, done.stderr
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(count)]
    assert all(r["response"]["status_code"] == 200 and len(r["response"]["body"]["data"]) == 1 for r in results)

    again = batch(server, source, output)  # complete: nothing is sent again
    assert f"{count} of {count} rows written ({count} by an earlier run); this run 0 rows" in again.stderr
    assert output.read_text().count("\n") == count


def test_bad_lines_get_their_own_error_results_and_the_rest_is_answered(server, tmp_path):
    info = requests.get(f"{server.url('inference')}/predictions/tiny/1.0/info", headers=server.auth(), timeout=30)
    too_many = info.json()["max_client_batch_size"] + 1
    source = tmp_path / "requests.jsonl"
    source.write_text("".join([
        request_line("ok-0", {"input": "a cat"}),
        "{not json\n",
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/embeddings", "body": {"input": "x"}}) + "\n",
        json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {}}) + "\n",
        request_line("rerank", {"query": "q", "documents": ["d"]}).replace("/v1/embeddings", "/v1/rerank"),
        request_line("big", {"input": ["x"] * too_many}),  # over the service's limit: its own 413
        request_line("ok-1", {"input": "a car"}),
    ]))
    done = batch(server, source, tmp_path / "results.jsonl")
    assert "2 succeeded, 5 failed (not sent: 4, 413: 1)" in done.stderr, done.stderr
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["ok-0", None, "get", "chat", "rerank", "big", "ok-1"]
    assert [r["response"] and r["response"]["status_code"] for r in results] == [200, None, None, None, None, 413, 200]
    messages = [r["error"] and r["error"]["message"] for r in results]
    assert "requests.jsonl:2: not a JSON line" in messages[1]
    assert "requests.jsonl:3: 'method' must be \"POST\"" in messages[2]
    assert "requests.jsonl:4: 'url' '/v1/chat/completions' is not one" in messages[3]
    assert "model tiny (task: embed) does not serve /v1/rerank" in messages[4]
    assert all(r["error"]["code"] == "invalid_request" for r in results[1:5])
    assert str(too_many) in results[5]["response"]["body"]["error"]["message"]


def test_a_worker_restarted_mid_job_loses_no_row(server, tmp_path):
    texts = varied_texts(5_000, seed=9)  # the kill comes after 500, with over 500 requests of 8 to go
    ids = [f"doc-{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"doc_id": ids, "text": texts}), tmp_path / "corpus.parquet")
    output = tmp_path / "vectors.jsonl"  # flushed after each request: its lines show the progress
    running = batch(server, tmp_path / "corpus.parquet", output, "--id-column", "doc_id", "--rows-per-request", "8",
                    background=True)
    deadline = time.monotonic() + 120
    while not output.exists() or output.read_bytes().count(b"\n") < 500:
        assert running.poll() is None and time.monotonic() < deadline, "the job ended or stalled before the kill"
        time.sleep(0.05)
    [worker] = model_workers(server, "tiny")
    os.kill(worker["pid"], signal.SIGKILL)
    assert running.poll() is None, "the job ended before the kill"
    assert running.wait(timeout=300) == 0
    wait_replaced(server, "tiny", {worker["pid"]}, 1, timeout=120)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert rows[-1]["id"] == ids[-1] and len(rows) < len(texts) * 2  # the kill came before the end
    assert [r["id"] for r in rows] == ids  # every row once, in order
    assert all(r["error"] is None and len(r["embedding"]) == 32 for r in rows)


def test_a_job_level_failure_exits_non_zero_and_names_the_problem(server, tmp_path):
    (tmp_path / "table.jsonl").write_text('{"text": "a"}\n{"text": 42}\n')
    done = batch(server, tmp_path / "table.jsonl", tmp_path / "out.jsonl", check=False)
    assert done.returncode == 1 and "table.jsonl:2" in done.stderr, done.stderr
    assert not (tmp_path / "out.jsonl").exists()

    command = [str(COMMAND), "batch", str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), "--url",
               server.url("inference"), "--model", "tiny", "--key", "wrong"]
    (tmp_path / "in.jsonl").write_text(request_line("a", {"input": "x"}))
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "refused the inference key" in refused.stderr, refused.stderr


def test_with_no_flags_the_working_directory_s_server_model_and_key_are_used(server, tmp_path):
    """`embedserve batch IN OUT` where the server runs (its config.properties and key_file.json
    there), no key exported: the model is the one the lines name; a table, naming none, stops
    while the server has several models, naming them."""
    env = {k: v for k, v in os.environ.items() if k not in ("KEY", "EMBEDSERVE_KEY")}
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("".join(request_line(f"r{i}", {"model": "tiny", "input": f"text {i}"}) for i in range(12)))
    done = subprocess.run([str(COMMAND), "batch", str(source), str(output)], cwd=server.workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "12 succeeded" in done.stderr, done.stderr
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(12)]
    assert all(r["response"]["status_code"] == 200 and len(r["response"]["body"]["data"][0]["embedding"]) == 32
               for r in results)
    direct = predict(server, {"input": "text 3"}, path="v1/embeddings").json()["data"][0]["embedding"]
    assert results[3]["response"]["body"]["data"][0]["embedding"] == direct

    (tmp_path / "table.jsonl").write_text('{"text": "a"}\n')
    table = subprocess.run([str(COMMAND), "batch", str(tmp_path / "table.jsonl"), str(tmp_path / "vectors.jsonl")],
                           cwd=server.workdir, env=env, capture_output=True, text=True, timeout=120)
    assert table.returncode == 1 and "give --model" in table.stderr, table.stderr
    assert all(name in table.stderr for name in server.models), table.stderr
