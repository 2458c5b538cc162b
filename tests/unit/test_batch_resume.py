"""embedserve batch's resume: what a killed run left is found again (a torn last line cut away,
a half-written Parquet part dropped), and a rerun against another input is refused."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from embedserve.batch import resume
from embedserve.batch.cli import Job, parser
from embedserve.batch.outputs import JsonlOutput, ParquetOutput
from embedserve.batch.server import JobError


def test_a_torn_last_line_is_cut_away(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "resp')
    assert resume.complete_lines(path) == (2, b'{"custom_id": "b"}')
    assert path.read_bytes() == b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
    assert resume.complete_lines(path) == (2, b'{"custom_id": "b"}')  # nothing more to cut


def test_lines_longer_than_a_read_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(resume, "CHUNK", 7)
    path = tmp_path / "out.jsonl"
    lines = [json.dumps({"id": i, "pad": "x" * (i * 5)}).encode() for i in range(6)]
    path.write_bytes(b"\n".join(lines) + b"\n" + b'{"id": 6, "torn')
    assert resume.complete_lines(path) == (6, lines[-1])
    assert path.read_bytes().endswith(lines[-1] + b"\n")


def test_no_output_and_an_empty_one(tmp_path):
    assert resume.complete_lines(tmp_path / "missing.jsonl") == (0, None)
    (tmp_path / "torn.jsonl").write_bytes(b'{"id": 0, "embed')
    assert resume.complete_lines(tmp_path / "torn.jsonl") == (0, None)
    assert (tmp_path / "torn.jsonl").read_bytes() == b""


def test_a_jsonl_output_continues_after_its_last_row(tmp_path):
    output = JsonlOutput(tmp_path / "out.jsonl", "id")
    output.start(restart=False)
    output.write_rows([0, 1], [np.ones(3, np.float32), None], [None, "HTTP 400: bad"])
    output.close(complete=False)
    with (tmp_path / "out.jsonl").open("ab") as f:
        f.write(b'{"id": 2, "embedding": [0.5, ')  # killed while writing row 2
    again = JsonlOutput(tmp_path / "out.jsonl", "id")
    assert again.resume() == (2, 1)
    again.start(restart=False)
    again.write_rows([2], [np.zeros(3, np.float32)], [None])
    again.close(complete=True)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2]
    assert rows[0]["embedding"] == [1.0, 1.0, 1.0] and rows[1] == {"id": 1, "embedding": None, "error": "HTTP 400: bad"}


def test_parquet_parts_survive_a_kill_and_assemble_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr("embedserve.batch.outputs.PART_ROWS", 4)
    path = tmp_path / "out.parquet"
    output = ParquetOutput(path, values=3)
    output.start(restart=False)
    for start in range(0, 10, 2):  # parts of rows 0-3 and 4-7; rows 8-9 still buffered at the "kill"
        output.write_rows([start, start + 1], [np.full(3, start, np.float32), None], [None, "no text"])
    (output.parts / f"{resume.part_name(8)}.tmp").write_bytes(b"half a part")  # the kill, mid-write
    again = ParquetOutput(path, values=3)
    assert again.resume() == (8, 7)
    again.start(restart=False)
    assert not list(again.parts.glob("*.tmp"))
    again.write_rows([8, 9, 10], [np.ones(3, np.float32)] * 3, [None] * 3)
    again.close(complete=True)
    assert not again.parts.exists()
    table = pq.read_table(path)
    assert str(table.schema.field("embedding").type) == "fixed_size_list<element: float>[3]"
    assert table.column("id").to_pylist() == list(range(11))
    embeddings = table.column("embedding").to_pylist()
    assert embeddings[0] == [0.0] * 3 and embeddings[1] is None and embeddings[4] == [4.0] * 3
    assert table.column("error").to_pylist()[:2] == [None, "no text"]


def job(tmp_path: Path, source: Path, output: Path) -> Job:
    args = parser().parse_args([str(source), str(output), "--key", "k", "--retries", "1", "--timeout", "5",
                                "--url", "http://127.0.0.1:1", "--model", "m"])
    return Job(args, threading.Event())


def batch_lines(ids):
    return "".join(json.dumps({"custom_id": i, "method": "POST", "url": "/v1/embeddings", "body": {"input": i}}) + "\n"
                   for i in ids)


def test_a_rerun_checks_the_output_against_its_input(tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(batch_lines(["a", "b", "c", "d"]))
    output.write_text("".join(json.dumps({"custom_id": i}) + "\n" for i in ("a", "b")))
    first = job(tmp_path, source, output)
    assert first._resume(JsonlOutput(output, "custom_id"), first.source.scan()) == 2

    source.write_text(batch_lines(["a", "x", "c", "d"]))  # another input
    other = job(tmp_path, source, output)
    with pytest.raises(JobError, match=r"ends with row 2 named 'b', but row 2 of .* is 'x'"):
        other._resume(JsonlOutput(output, "custom_id"), other.source.scan())

    source.write_text(batch_lines(["a"]))
    shorter = job(tmp_path, source, output)
    with pytest.raises(JobError, match="holds 2 rows, more than the 1"):
        shorter._resume(JsonlOutput(output, "custom_id"), shorter.source.scan())
