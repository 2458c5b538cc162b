"""The Ray Data path on a real two-node Ray cluster on this machine (tests/support/ray_cluster.py),
run as a user runs it (`python -m embedserve.ray_data`) on the archives the session's TorchServe
serves: the job's actors spread over both nodes, vectors the same bytes the service answers, rows the
service would refuse failing alone; and every row exactly once after an actor, or a whole node, is
killed in the middle of the job.

One cluster serves the module's jobs, as a user's cluster serves one job after another: each test
counts only the actors its own job started (JobActors), and the test that loses a node runs last.

Ray's own servers listen on every interface (no Ray option binds them to loopback); the cluster
advertises 127.0.0.1 and refuses clients without its token."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from tests.support import REPO
from tests.support.client import predict
from tests.support.inputs import varied_texts
from tests.support.ray_cluster import RayCluster

pytestmark = pytest.mark.integration

JOB_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cluster():
    ray_cluster = RayCluster().start()
    try:
        yield ray_cluster
    finally:
        ray_cluster.stop()


@pytest.fixture(scope="module")
def st_model(tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(tiny_model_dir), device="cpu")


def job(cluster, server, model, source, output, *args, background=False):
    command = [sys.executable, "-m", "embedserve.ray_data", str(source), str(output),
               "--archive", str(server.workdir / "model_store" / f"{model}.mar"), *map(str, args)]
    env = {**os.environ, **cluster.env}
    if background:  # its log in a file: a pipe nobody reads while it runs would fill and stop it
        with Path(output).with_suffix(".log").open("w") as log:
            return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def corpus(path: Path, texts: list) -> list[str]:
    ids = [f"doc-{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"doc_id": ids, "text": pa.array(texts, pa.string())}), path, row_group_size=50)
    return ids


def read_output(output: Path) -> pa.Table:
    return pq.read_table(output).sort_by("doc_id")


def embedded_once(output: Path, ids: list[str]) -> pa.Table:
    """The output, after checking that it holds each input row exactly once, each with its vector."""
    table = read_output(output)
    assert table.num_rows == len(ids), f"{table.num_rows} rows written for {len(ids)}"
    assert sorted(table.column("doc_id").to_pylist()) == sorted(ids)
    assert table.column("embedding").null_count == 0, table.column("error").drop_null().to_pylist()[:3]
    return table


def vectors(table: pa.Table) -> np.ndarray:
    column = table.column("embedding").combine_chunks()
    return column.values.to_numpy().reshape(len(column), -1)


def test_a_two_node_job_gives_the_services_vectors_for_every_row(cluster, server, st_model, tmp_path):
    texts = varied_texts(400, seed=11)
    max_chars = requests_info(server)["max_input_chars"]
    cells = [*texts, None, "", "y" * (max_chars + 1)]
    ids = corpus(tmp_path / "corpus.parquet", cells)
    actors = JobActors(cluster)
    done = job(cluster, server, "tiny", tmp_path / "corpus.parquet", tmp_path / "out", "--actors", "2",
               "--batch-rows", "40")
    assert f"{len(cells)} rows embedded" in done.stderr and "3 failed" in done.stderr, done.stderr[-2000:]

    table = read_output(tmp_path / "out")
    assert table.column_names == ["doc_id", "embedding", "error"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    assert sorted(table.column("doc_id").to_pylist()) == sorted(ids)
    by_id = {row["doc_id"]: row for row in table.to_pylist()}
    refused = [by_id[f"doc-{i}"] for i in range(len(texts), len(cells))]
    assert all(row["embedding"] is None for row in refused)
    assert refused[0]["error"].startswith("not sent: no text") and "empty text" in refused[1]["error"]
    assert f"max_input_chars={max_chars}" in refused[2]["error"]

    served = np.array([by_id[i]["embedding"] for i in ids[:len(texts)]], np.float32)
    answers = []
    for start in range(0, len(texts), 100):
        answer = predict(server, {"input": texts[start:start + 100], "encoding_format": "base64"},
                         path="v1/embeddings")
        assert answer.status_code == 200, answer.text
        answers += [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in answer.json()["data"]]
    assert served.tobytes() == np.stack(answers).tobytes()  # the service's vectors, byte for byte
    reference = st_model.encode(texts, normalize_embeddings=True)
    assert np.sum(served * reference, axis=1).min() >= 0.9999

    # The job's actors: one, or one on each node. A 400-row job can be done by the first actor
    # before the second has loaded its archive, and Ray stops that one unready (a busy machine
    # did); the spread over both nodes is asserted where both are ready, mid-job (the node test).
    assert 1 <= actors.count() <= 2 and actors.nodes() <= set(ready_nodes(cluster)), actors.ready()


def requests_info(server) -> dict:
    answer = requests.get(f"{server.url('inference')}/predictions/tiny/1.0/info", headers=server.auth(), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


# The fault tests: a corpus long enough that the job is still embedding when the fault comes (80
# batches of 100 rows; survives() asserts files were written after it).
FAULT_ROWS = 8_000
EMBEDDER = "ArchiveEmbedder"


def ready_nodes(cluster) -> Counter:
    """How many actors got ready on each node, in the cluster's life."""
    return Counter(re.findall(r"embedder ready on node (\w+)", cluster.logs()))


class JobActors:
    """The actors that got ready since this was made: those of the job started after it."""

    def __init__(self, cluster):
        self.cluster, self.before = cluster, ready_nodes(cluster)

    def ready(self) -> Counter:
        return ready_nodes(self.cluster) - self.before

    def count(self) -> int:
        return sum(self.ready().values())

    def nodes(self) -> set[str]:
        return set(self.ready())


def in_full_swing(actors: JobActors, output: Path, running: subprocess.Popen, timeout_s: float = 300) -> None:
    """Wait until both actors are ready and the job has written its first output file."""
    deadline = time.monotonic() + timeout_s
    while actors.count() < 2 or not list(output.glob("*.parquet")):
        assert running.poll() is None, f"the job ended before writing: {job_log(output)[-3000:]}"
        assert time.monotonic() < deadline, f"not under way in time: {actors.ready()}"
        time.sleep(0.2)


def job_log(output: Path) -> str:
    return output.with_suffix(".log").read_text(errors="replace")


def finished(running: subprocess.Popen, output: Path) -> str:
    running.wait(timeout=JOB_TIMEOUT_S)
    assert running.returncode == 0, job_log(output)[-3000:]
    return job_log(output)


def same_as_served(server, table: pa.Table, texts: list[str], sample: int = 300) -> None:
    """The vectors of a sample of rows are the service's, byte for byte."""
    by_id = dict(zip(table.column("doc_id").to_pylist(), vectors(table)))
    picked = np.random.default_rng(0).choice(len(texts), sample, replace=False)
    answer = predict(server, {"input": [texts[i] for i in picked], "encoding_format": "base64"},
                     path="v1/embeddings")
    assert answer.status_code == 200, answer.text
    served = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in answer.json()["data"]]
    assert all(by_id[f"doc-{i}"].tobytes() == vector.tobytes() for i, vector in zip(picked, served))


def survives(cluster, server, tmp_path: Path, seed: int, fault) -> JobActors:
    """`fault(actors)` in the middle of a job, both actors at work: it still ends with every row
    once, each the service's vector. The job's actors."""
    texts = varied_texts(FAULT_ROWS, seed=seed)
    ids = corpus(tmp_path / "corpus.parquet", texts)
    actors = JobActors(cluster)
    running = job(cluster, server, "tiny", tmp_path / "corpus.parquet", tmp_path / "out", "--actors", "2",
                  "--batch-rows", "100", background=True)
    in_full_swing(actors, tmp_path / "out", running)
    written = len(list((tmp_path / "out").glob("*.parquet")))
    fault(actors)
    stderr = finished(running, tmp_path / "out")
    assert f"{FAULT_ROWS} rows embedded" in stderr and ", 0 failed" in stderr, stderr[-2000:]
    assert written < len(list((tmp_path / "out").glob("*.parquet"))), "the fault came after the last write"
    same_as_served(server, embedded_once(tmp_path / "out", ids), texts)
    return actors


def test_an_actor_killed_mid_job_leaves_every_row_exactly_once(cluster, server, tmp_path):
    def kill_an_actor(actors):
        # An actor at work, not one the pool is still starting: the pool may replace one it let go,
        # so a third title (`...__init__`) can show beside the two at work.
        at_work = [p for p in cluster.actor_processes(EMBEDDER) if not p.info["cmdline"][0].endswith("__init__")]
        assert 1 <= len(at_work) <= 2, [p.info["cmdline"][0] for p in at_work]
        at_work[0].kill()  # SIGKILL

    actors = survives(cluster, server, tmp_path, 5, kill_an_actor)
    assert actors.count() >= 3  # Ray started another actor


# Last of the module: the cluster has one node after it.
def test_a_node_lost_mid_job_leaves_every_row_exactly_once(cluster, server, tmp_path):
    def lose_the_second_node(actors):
        assert len(actors.nodes()) == 2, actors.ready()  # an actor on each node
        cluster.second_node_raylet().kill()  # the node goes, its actor with it

    survives(cluster, server, tmp_path, 6, lose_the_second_node)
