"""The job: entries from the input, requests through the pool, results to the output in order.

Batch-file lines go to the service one request each, as written. Table rows go in groups
(grouping.py) to the OpenAI route as base64 float32 (exact, and a third the size of JSON
numbers); a group the service refuses (400, 413, 422, 500, 507) is split in halves until the rows
at fault are alone, so one bad row fails alone, as a bad request fails alone in the service."""

from __future__ import annotations

import base64
import threading
from typing import Any, Callable, Iterator

import numpy as np
import orjson

from embedserve.batch.client import Client
from embedserve.batch.grouping import Group
from embedserve.batch.inputs import BATCH_ROUTES, Line
from embedserve.batch.outputs import error_message, result_line
from embedserve.batch.pool import OrderedPool
from embedserve.batch.progress import Progress, Tally
from embedserve.batch.server import Endpoint, JobError

# A group refused with one of these is split, to find the rows at fault; another status fails all its rows.
SPLIT_STATUSES = frozenset({400, 413, 422, 500, 507})
NOT_SENT = "not sent"


class Runner:
    def __init__(self, client: Client, endpoint: Endpoint, output, tally: Tally, progress: Progress,
                 concurrency: int, stop: threading.Event):
        self.client, self.endpoint, self.output = client, endpoint, output
        self.tally, self.progress, self.stop = tally, progress, stop
        self.pool = OrderedPool(concurrency, 4 * concurrency, stop)
        self._count = threading.Lock()

    def _sent(self) -> None:
        with self._count:
            self.tally.requests += 1

    # --- batch files ---------------------------------------------------------------------------

    def run_lines(self, lines: Iterator[Line]) -> None:
        for line, status in self.pool.map(self._line_call(line) for line in lines):
            self.output.write_lines([line])
            self._advance(1, [status])

    def _line_call(self, line: Line) -> Callable[[], tuple[bytes, int]]:
        url = self.endpoint.route(BATCH_ROUTES[line.url])

        def call():
            answer = self.client.post(url, line.body)
            self._sent()
            return result_line(line.custom_id, answer), answer.status
        return call

    # --- tables --------------------------------------------------------------------------------

    def run_groups(self, groups: Iterator[Group], options: dict[str, Any], values: int) -> None:
        url = self.endpoint.route("v1/embeddings")
        for ids, vectors, errors, statuses in self.pool.map(self._group_call(g, url, options, values) for g in groups):
            self.output.write_rows(ids, vectors, errors)
            self._advance(len(ids), statuses)

    def _group_call(self, group: Group, url: str, options: dict[str, Any], values: int):
        def call():
            texts = group.texts
            sent = iter(self._embed(url, texts, options, values) if texts else [])
            ids, vectors, errors, statuses = [], [], [], []
            for i, row in enumerate(group.rows):
                ids.append(row.id)
                if i in group.refused:
                    vector, error, status = None, f"{NOT_SENT}: {group.refused[i]}", NOT_SENT
                else:
                    vector, error, status = next(sent)
                vectors.append(vector)
                errors.append(error)
                statuses.append(status)
            return ids, vectors, errors, statuses
        return call

    def _embed(self, url: str, texts: list[str], options: dict[str, Any], values: int) -> list[tuple]:
        """(vector, None, 200) or (None, error, status) for each text, in order."""
        body = orjson.dumps({**options, "model": self.endpoint.model, "input": texts, "encoding_format": "base64"})
        answer = self.client.post(url, body)
        self._sent()
        if answer.status == 200:
            return [(v, None, 200) for v in decode_vectors(answer.body, len(texts), values)]
        if answer.status in SPLIT_STATUSES and len(texts) > 1:
            half = len(texts) // 2
            return self._embed(url, texts[:half], options, values) + self._embed(url, texts[half:], options, values)
        return [(None, error_message(answer), answer.status)] * len(texts)

    def _advance(self, rows: int, statuses: list) -> None:
        self.tally.rows += rows
        for status in statuses:
            if status != 200:
                self.tally.failed[status] += 1
        self.progress.advance(rows)


def decode_vectors(body: bytes, count: int, values: int) -> list[np.ndarray]:
    """The float32 vectors of an OpenAI-shape answer in base64, in input order."""
    try:
        data = sorted(orjson.loads(body)["data"], key=lambda d: d["index"])
        vectors = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise JobError(f"the service answered 200 with a body this command cannot read ({err}): {body[:200]!r}")
    if len(vectors) != count or any(len(v) != values for v in vectors):
        raise JobError(f"the service answered {len(vectors)} vectors of {sorted({len(v) for v in vectors})} values "
                       f"for {count} texts of {values}")
    return vectors
