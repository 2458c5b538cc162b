"""The job: entries from the input, requests through the pool, results to the output in order.

Batch-file lines go to the service one request each, as written. Table rows go in groups
(grouping.py) to the OpenAI route, each group's rows embedded as embedding.py does it (a refused
group split until the rows at fault are alone)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

from embedserve.batch.client import Answer, Client
from embedserve.batch.embedding import NOT_SENT, group_outcomes
from embedserve.batch.grouping import Group
from embedserve.batch.inputs import BATCH_ROUTES, Line
from embedserve.batch.outputs import refused_line, result_line
from embedserve.batch.pool import OrderedPool
from embedserve.batch.progress import Progress, Tally
from embedserve.batch.server import Endpoint


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

    def run_lines(self, lines: Iterator[Line], unserved: dict[str, str]) -> None:
        """`unserved`: the urls the model does not serve, and why."""
        for line, status in self.pool.map(self._line_call(line, unserved) for line in lines):
            self.output.write_lines([line])
            self._advance(1, [status])

    def _line_call(self, line: Line, unserved: dict[str, str]) -> Callable[[], tuple[bytes, int | str]]:
        if line.error is not None or line.url in unserved:
            refused = refused_line(line.custom_id, line.error or unserved[line.url])
            return lambda: (refused, NOT_SENT)
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
        def post(body: bytes) -> Answer:
            answer = self.client.post(url, body)
            self._sent()
            return answer

        def call():
            outcomes = group_outcomes(post, group, options, self.endpoint.model, values)
            return [row.id for row in group.rows], *(list(column) for column in zip(*outcomes))
        return call

    def _advance(self, rows: int, statuses: list) -> None:
        self.tally.rows += rows
        for status in statuses:
            if status != 200:
                self.tally.failed[status] += 1
        self.progress.advance(rows)

