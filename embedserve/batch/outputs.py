"""The result writers, each writing rows in input order as the runner hands them over.

- batch results: the OpenAI batch output format, one JSONL line a batch-file line, the service's
  answer kept byte for byte as the line's `response.body`;
- table JSONL: `{"id", "embedding", "error"}` a row;
- Parquet: the columns `id`, `embedding` (fixed_size_list<float32>, what vector databases import)
  and `error`, written as part files during the run and put together into the output at the end.

A row that failed has a null embedding and its `error`: the status and the service's message, or
why the row was not sent."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from embedserve.batch.client import Answer
from embedserve.batch.resume import complete_lines, complete_parts, part_name
from embedserve.batch.retry import torchserve_error

FSYNC_S = 5.0  # flushed after every request; on disk (fsync) at most this long after
PART_ROWS = 50_000  # rows a Parquet part holds at most ...
PART_S = 60.0  # ... or that the part's first row waited: what a kill can cost


def result_line(custom_id: str, answer: Answer) -> bytes:
    """One line of the OpenAI batch output. The body is the service's answer as it came (one line
    of JSON from the handler); a body on several lines (TorchServe's own errors) is rewritten on
    one, and a body that is no JSON at all (TorchServe's 413 to an oversized body is empty) is
    null, with the line's `error` saying what came."""
    error = None
    try:
        parsed = orjson.loads(answer.body)
        body = answer.body.strip() if b"\n" not in answer.body.strip() else orjson.dumps(parsed)
    except orjson.JSONDecodeError:
        body = b"null"
        error = {"code": "invalid_response", "message": f"HTTP {answer.status} with a body that is not JSON: "
                 f"{answer.body[:200].decode(errors='replace')!r}"}
    head = orjson.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id})[:-1]
    response = orjson.dumps({"status_code": answer.status, "request_id": answer.request_id})[:-1]
    return b"%s,\"response\":%s,\"body\":%s},\"error\":%s}\n" % (head, response, body, orjson.dumps(error))


def error_message(answer: Answer) -> str:
    """`HTTP <status>: <the service's message>` for a table row's `error`."""
    message = answer.body[:300].decode(errors="replace")
    try:
        parsed = orjson.loads(answer.body)
        own = torchserve_error(answer.body)
        if own is not None:
            message = str(own.get("message"))
        elif isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            message = str(parsed["error"].get("message"))
        elif isinstance(parsed, dict) and "error" in parsed:
            message = str(parsed["error"])
    except orjson.JSONDecodeError:
        pass
    return f"HTTP {answer.status}: {message}"


def refused_line(custom_id: str | None, message: str) -> bytes:
    """The output line of a batch-file line that was not sent: no response, and why, as OpenAI's
    batch output gives a request that got none."""
    return orjson.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                         "error": {"code": "invalid_request", "message": message}}) + b"\n"


class JsonlOutput:
    """Lines appended in order and flushed after each request's rows."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key  # key: the field that names a row ("custom_id", "id")
        self._file = None
        self._synced = time.monotonic()

    def resume(self) -> tuple[int, Any]:
        done, last = complete_lines(self.path)
        return done, orjson.loads(last).get(self.key) if last else None

    def start(self, restart: bool) -> None:
        self._file = self.path.open("wb" if restart else "ab")

    def write_lines(self, lines: list[bytes]) -> None:
        self._file.write(b"".join(lines))
        self._file.flush()
        if time.monotonic() - self._synced > FSYNC_S:
            os.fsync(self._file.fileno())
            self._synced = time.monotonic()

    def write_rows(self, ids: list, vectors: list, errors: list) -> None:
        self.write_lines([orjson.dumps({"id": i, "embedding": v, "error": e}, option=orjson.OPT_SERIALIZE_NUMPY)
                          + b"\n" for i, v, e in zip(ids, vectors, errors)])

    def close(self, complete: bool) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def vector_column(vectors: list[np.ndarray | None], values: int):
    """An Arrow fixed_size_list<float32>[values] column, null where a row has no vector."""
    import pyarrow as pa

    missing = np.array([v is None for v in vectors], dtype=bool)
    filler = np.zeros(values, np.float32)
    flat = np.concatenate([filler if v is None else v for v in vectors] or [np.zeros(0, np.float32)])
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.astype(np.float32, copy=False)), values,
                                             mask=pa.array(missing) if missing.any() else None)


class ParquetOutput:
    """Rows buffered into part files in `<output>.parts/`, each renamed into place once complete;
    at the end the parts become the output's row groups, in order, and the folder goes."""

    def __init__(self, path: Path, values: int):
        self.path, self.values = path, values
        self.parts = path.with_name(path.name + ".parts")
        self._rows = 0  # rows in complete parts
        self._ids, self._vectors, self._errors = [], [], []
        self._since = time.monotonic()

    def resume(self) -> tuple[int, Any]:
        import pyarrow.parquet as pq

        parts = complete_parts(self.parts)
        if not parts:
            return 0, None
        last_path, _ = parts[-1]
        ids = pq.read_table(last_path, columns=["id"]).column("id")
        return sum(rows for _, rows in parts), ids[len(ids) - 1].as_py()

    def start(self, restart: bool) -> None:
        if restart:
            shutil.rmtree(self.parts, ignore_errors=True)
        self.parts.mkdir(parents=True, exist_ok=True)
        self._rows = sum(rows for _, rows in complete_parts(self.parts))

    def write_rows(self, ids: list, vectors: list, errors: list) -> None:
        if not self._ids:
            self._since = time.monotonic()
        self._ids += ids
        self._vectors += vectors
        self._errors += errors
        if len(self._ids) >= PART_ROWS or time.monotonic() - self._since > PART_S:
            self._write_part()

    def _write_part(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._ids:
            return
        table = pa.table({"id": pa.array(self._ids), "embedding": vector_column(self._vectors, self.values),
                          "error": pa.array(self._errors, pa.string())})
        name = part_name(self._rows)
        pq.write_table(table, self.parts / f"{name}.tmp")
        os.replace(self.parts / f"{name}.tmp", self.parts / name)
        self._rows += len(self._ids)
        self._ids, self._vectors, self._errors = [], [], []

    def close(self, complete: bool) -> None:
        self._write_part()
        if complete:
            self._assemble()

    def _assemble(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = [path for path, _ in complete_parts(self.parts)]
        schema = pa.unify_schemas([pq.read_schema(p) for p in parts], promote_options="permissive") if parts else \
            pa.schema([("id", pa.int64()), ("embedding", pa.list_(pa.float32(), self.values)), ("error", pa.string())])
        partial = self.path.with_name(self.path.name + ".tmp")
        with pq.ParquetWriter(partial, schema) as writer:
            for part in parts:
                writer.write_table(pq.read_table(part).cast(schema))
        os.replace(partial, self.path)
        shutil.rmtree(self.parts)
