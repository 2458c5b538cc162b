"""embedserve batch's inputs: batch files and tables read in order from any row, and every bad
input refused before anything is sent, with a message naming the file and line."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedserve.batch.inputs import BatchFile, InputError, Row, Table, detect_format


def line(custom_id="a", url="/v1/embeddings", body=None, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body or {"input": "x"}})


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_batch_file_is_read_in_order_from_any_line(tmp_path):
    path = write(tmp_path / "in.jsonl", [line(f"r{i}", body={"input": f"text {i}"}) for i in range(5)] + [""])
    source = BatchFile(path)
    assert source.scan() == 5 and source.urls == {"/v1/embeddings"}
    assert [e.custom_id for e in source.entries(3)] == ["r3", "r4"]
    assert json.loads(next(source.entries(1)).body) == {"input": "text 1"}


@pytest.mark.parametrize("bad, message", [
    ("{not json", r"in\.jsonl:3: not a JSON line"),
    ('["a list"]', r"in\.jsonl:3: a line must be a JSON object"),
    (line(custom_id=""), r"in\.jsonl:3: 'custom_id' must be a non-empty string"),
    (line(method="GET"), r"in\.jsonl:3: 'method' must be \"POST\""),
    (line(url="/v1/chat/completions"), r"in\.jsonl:3: 'url' '/v1/chat/completions' is not one"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": "x"}),
     r"in\.jsonl:3: 'body' must be a JSON object"),
])
def test_a_bad_batch_line_is_named_and_not_sent(tmp_path, bad, message):
    path = write(tmp_path / "in.jsonl", [line("r0"), line("r1"), bad, line("r3")])
    source = BatchFile(path)
    assert source.scan() == 4 and source.urls == {"/v1/embeddings"}  # the bad line's url is not sent
    entries = list(source.entries())
    assert [e.error is None for e in entries] == [True, True, False, True]
    assert re.search(message, entries[2].error), entries[2].error


def test_formats_are_told_from_the_file(tmp_path):
    assert detect_format(write(tmp_path / "a.jsonl", [line()]), None) == "batch"
    assert detect_format(write(tmp_path / "b.jsonl", ['{"text": "x"}']), None) == "jsonl"
    assert detect_format(tmp_path / "c.parquet", None) == "parquet"
    assert detect_format(tmp_path / "d.csv", None) == "csv"
    assert detect_format(tmp_path / "e.txt", "csv") == "csv"
    with pytest.raises(InputError, match="give --input-format"):
        detect_format(tmp_path / "e.txt", None)


def test_table_formats_give_the_same_rows(tmp_path):
    texts, ids = ["hello", None, "wörld, \"quoted\"\nnewline"], ["a", "b", "c"]
    pq.write_table(pa.table({"key": ids, "body": texts}), tmp_path / "t.parquet")
    write(tmp_path / "t.jsonl", [json.dumps({"key": k, "body": t}) for k, t in zip(ids, texts)])
    (tmp_path / "t.csv").write_text('key,body\na,hello\nb,\nc,"wörld, ""quoted""\nnewline"\n')
    expected = [Row(k, t) for k, t in zip(ids, texts)]
    for fmt in ("parquet", "jsonl", "csv"):
        table = Table(tmp_path / f"t.{fmt}", fmt, "body", "key")
        assert table.scan() == 3
        assert list(table.entries()) == expected, fmt
        assert list(table.entries(2)) == expected[2:], fmt
    assert list(Table(tmp_path / "t.jsonl", "jsonl", "body", None).entries(1)) == [Row(1, None), Row(2, texts[2])]


def test_parquet_rows_from_any_row_across_batches(tmp_path):
    pq.write_table(pa.table({"text": [f"t{i}" for i in range(20_000)]}), tmp_path / "big.parquet", row_group_size=3000)
    rows = list(Table(tmp_path / "big.parquet", "parquet", "text", None).entries(12_345))
    assert rows[0] == Row(12_345, "t12345") and rows[-1] == Row(19_999, "t19999") and len(rows) == 7655


@pytest.mark.parametrize("fmt, content, message", [
    ("jsonl", '{"text": "a"}\n{"text": 5}\n', r"t\.jsonl:2: 'text' must be a string, got int"),
    ("jsonl", '{"text": "a"}\n\n{"other": "b"}\n', r"t\.jsonl:3: no 'text' column"),
    ("jsonl", '{"text": "a"}\n{"text": "b"\n', r"t\.jsonl:2: not a JSON line"),
    ("csv", "id,body\n1,x\n", r"t\.csv:2: no 'text' column"),
    ("csv", b"text\nok\n\xff\xfe bad\n", r"t\.csv:3: not UTF-8"),
])
def test_a_bad_table_row_is_named(tmp_path, fmt, content, message):
    path = tmp_path / f"t.{fmt}"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(InputError, match=message):
        Table(path, fmt, "text", None).scan()


def test_a_parquet_table_without_strings_is_refused(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(InputError, match="column 'text' holds int64, not strings"):
        Table(tmp_path / "n.parquet", "parquet", "text", None).scan()
    with pytest.raises(InputError, match="no 'doc' column; it has text"):
        Table(tmp_path / "n.parquet", "parquet", "doc", None).scan()
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        Table(tmp_path / "broken.parquet", "parquet", "text", None).scan()
