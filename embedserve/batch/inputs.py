"""The input, checked and read row by row: an OpenAI batch file, or a table (Parquet, JSONL, CSV)
with a text column and an optional id column.

Every input is read once in full before anything is sent (`scan`, which also counts the rows for
the progress bar): a table that cannot be read as one (a missing column, a text that is not a
string) stops the job at once with a message naming the row, not after hours of embedding. A
batch-file line that is not a request this command can send (not JSON, a missing or wrong field,
a url it does not send) is not sent: it gets its own error result naming the line and why, and
the other lines are answered, as OpenAI's and vLLM's batch jobs do. Then `entries(skip)` reads
the input again in order, from the first row an earlier run did not write."""

from __future__ import annotations

import csv
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import orjson

from embedserve.batch.server import JobError

# Batch-file URLs (OpenAI's and vLLM's run_batch) -> the model's route that takes that body.
# vLLM's /rerank takes the same Jina/Cohere body as /v1/rerank (the server's /rerank is TEI's).
BATCH_ROUTES = {"/v1/embeddings": "v1/embeddings", "/v1/rerank": "v1/rerank", "/v2/rerank": "v2/rerank",
                "/rerank": "v1/rerank"}
TABLE_FORMATS = ("parquet", "jsonl", "csv")


class InputError(JobError):
    """The input file is not what the command reads; the message names the file and line."""


@dataclass(frozen=True)
class Line:
    """One request of an OpenAI batch file; `error` says why it is not sent (None: it is)."""

    custom_id: str | None  # None where the line has none that is a string
    url: str  # as written in the file ("/v1/embeddings")
    body: bytes  # the request body, as JSON
    error: str | None = None
    model: str | None = None  # the body's `model`, where a string


@dataclass(frozen=True)
class Row:
    """One row of a table; `text` None when the cell is empty (null): that row gets an error."""

    id: Any
    text: str | None


def detect_format(path: Path, given: str | None) -> str:
    """"batch" (an OpenAI batch file) or a table format, from --input-format, else the file."""
    if given:
        return given
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".json", ".ndjson"):
        with path.open("rb") as f:
            first = next((line for line in f if line.strip()), b"")
        try:
            head = orjson.loads(first) if first else {}
        except orjson.JSONDecodeError:
            raise InputError(f"{path}: the first line is not JSON") from None
        return "batch" if isinstance(head, dict) and "custom_id" in head and "body" in head else "jsonl"
    raise InputError(f"{path}: cannot tell the format from '{suffix}'; give --input-format "
                     f"(batch, {', '.join(TABLE_FORMATS)})")


class BatchFile:
    grouped = False

    def __init__(self, path: Path):
        self.path = path
        self.urls: set[str] = set()
        self.models: set[str] = set()  # the lines' body.model, the job's model unless --model says

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        with self.path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield number, raw

    def parse(self, number: int, raw: bytes) -> Line:
        where = f"{self.path}:{number}"
        try:
            entry = json_object_line(raw, where, "a line must be a JSON object with custom_id, method, url and body")
        except InputError as err:
            return Line(None, "", b"", str(err))
        custom_id, method, url, body = (entry.get(k) for k in ("custom_id", "method", "url", "body"))
        named = custom_id if isinstance(custom_id, str) else None

        def refused(why: str) -> Line:
            return Line(named, url if isinstance(url, str) else "", b"", f"{where}: {why}")

        if not isinstance(custom_id, str) or not custom_id:
            return refused("'custom_id' must be a non-empty string")
        if method != "POST":
            return refused(f"'method' must be \"POST\", got {method!r}")
        if url not in BATCH_ROUTES:
            return refused(f"'url' {url!r} is not one this command sends; it sends {', '.join(BATCH_ROUTES)}")
        if not isinstance(body, dict):
            return refused("'body' must be a JSON object (the request's body)")
        model = body.get("model")
        return Line(custom_id, url, orjson.dumps(body), model=model if isinstance(model, str) else None)

    def scan(self) -> int:
        count = 0
        for number, raw in self._lines():
            line = self.parse(number, raw)
            if line.error is None:
                self.urls.add(line.url)
                if line.model:
                    self.models.add(line.model)
            count += 1
        return count

    def entries(self, skip: int = 0) -> Iterator[Line]:
        for number, raw in itertools.islice(self._lines(), skip, None):
            yield self.parse(number, raw)


class Table:
    grouped = True
    models: frozenset[str] = frozenset()  # a table names no model

    def __init__(self, path: Path, fmt: str, text_column: str, id_column: str | None):
        self.path, self.format, self.text_column, self.id_column = path, fmt, text_column, id_column

    def scan(self) -> int:
        if self.format == "parquet":
            return self._parquet_file().metadata.num_rows
        return sum(1 for _ in self._rows())

    def entries(self, skip: int = 0) -> Iterator[Row]:
        if self.format == "parquet":
            yield from self._parquet_rows(skip)
        else:
            yield from itertools.islice(self._rows(), skip, None)

    def _row(self, where: str, text: Any, id_: Any, index: int) -> Row:
        if text is not None and not isinstance(text, str):
            raise InputError(f"{where}: '{self.text_column}' must be a string, got {type(text).__name__}")
        return Row(index if self.id_column is None else id_, text)

    def _rows(self) -> Iterator[Row]:
        reader = self._csv_rows if self.format == "csv" else self._jsonl_rows
        for index, (where, record) in enumerate(reader()):
            if self.text_column not in record:
                raise InputError(f"{where}: no '{self.text_column}' column (--text-column)")
            if self.id_column is not None and self.id_column not in record:
                raise InputError(f"{where}: no '{self.id_column}' column (--id-column)")
            yield self._row(where, record[self.text_column], record.get(self.id_column), index)

    def _jsonl_rows(self) -> Iterator[tuple[str, dict]]:
        with self.path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{self.path}:{number}"
                yield where, json_object_line(raw, where, "a row must be a JSON object")

    def _csv_rows(self) -> Iterator[tuple[str, dict]]:
        with self.path.open("rb") as f:
            reader = csv.DictReader(self._utf8_lines(f))
            try:
                for record in reader:
                    # an empty cell is no text, as a null is in Parquet and JSONL
                    yield f"{self.path}:{reader.line_num}", {k: (v or None) for k, v in record.items()}
            except csv.Error as err:
                raise InputError(f"{self.path}:{reader.line_num}: {err}") from None

    def _utf8_lines(self, f) -> Iterator[str]:
        """Lines decoded one by one, so that bytes that are not UTF-8 are named by their line."""
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(f"{self.path}:{number}: not UTF-8 ({err})") from None
            yield text.removeprefix("\ufeff") if number == 1 else text

    def _parquet_file(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            file = pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as err:
            raise InputError(f"{self.path}: not a readable Parquet file ({err})") from None
        schema = file.schema_arrow
        for column in filter(None, (self.text_column, self.id_column)):
            if column not in schema.names:
                raise InputError(f"{self.path}: no '{column}' column; it has {', '.join(schema.names)}")
        kind = schema.field(self.text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or (pa.types.is_dictionary(kind) and pa.types.is_string(kind.value_type))):
            raise InputError(f"{self.path}: column '{self.text_column}' holds {kind}, not strings")
        return file

    def _parquet_rows(self, skip: int) -> Iterator[Row]:
        file = self._parquet_file()
        columns = [self.text_column] + ([self.id_column] if self.id_column else [])
        index = 0
        for batch in file.iter_batches(batch_size=8192, columns=columns):
            if index + batch.num_rows <= skip:
                index += batch.num_rows
                continue
            texts = batch.column(self.text_column).to_pylist()
            ids = batch.column(self.id_column).to_pylist() if self.id_column else None
            for i, text in enumerate(texts):
                if index >= skip:
                    yield Row(index if ids is None else ids[i], text)
                index += 1


def json_object_line(raw: bytes, where: str, shape: str) -> dict:
    """One JSONL line as an object; InputError naming the line (`where`) otherwise."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise InputError(f"{where}: not a JSON line ({err})") from None
    if not isinstance(value, dict):
        raise InputError(f"{where}: {shape}")
    return value
