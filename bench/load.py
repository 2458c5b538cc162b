"""A closed-loop HTTP load generator: N concurrent clients, each sending its next request as soon
as the previous one is answered, on loopback only.

A warm-up phase (at least one request per client) is not counted. In the measured phase clients
stop sending after the set time and every request sent is awaited, so throughput is all texts
answered over the whole elapsed time, and slow scenarios (many texts per request) still count.

The clients are a small HTTP/1.1 client on asyncio's protocols, one keep-alive connection each,
each request's bytes written once: the load runs on the server's machine, and every core it takes
is one the server does not get. Against the tiny model's TorchServe on the 2-core machine (AMD
EPYC, 64 clients, in turns: `python -m bench.load_client`), it took 30-38 us of CPU a one-text
request where aiohttp, the client before it, took 117-130, and the server answered 1.55-1.63x
the requests a second.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import numpy as np


@dataclass(frozen=True)
class LoadResult:
    concurrency: int
    texts_per_request: int
    seconds: float
    requests: int
    texts: int
    tokens: int
    errors: dict[int, int]
    latencies_ms: list[float]

    def summary(self) -> dict:
        latencies = np.array(self.latencies_ms) if self.latencies_ms else np.array([np.nan])
        return {
            "concurrency": self.concurrency,
            "texts_per_request": self.texts_per_request,
            "seconds": round(self.seconds, 2),
            "requests": self.requests,
            "errors": self.errors,
            "texts_per_s": round(self.texts / self.seconds, 1),
            "tokens_per_s": round(self.tokens / self.seconds, 1),
            "p50_ms": round(float(np.percentile(latencies, 50)), 1),
            "p95_ms": round(float(np.percentile(latencies, 95)), 1),
            "p99_ms": round(float(np.percentile(latencies, 99)), 1),
        }


# The frontend is a JVM: its JIT compiles the code paths of a load shape for tens of seconds
# after it first sees it, on the cores the workers use. Measured on the 2-core machine, at one
# client right after 60 s at 64 clients: the compiler threads took 3.5 ms of CPU per request in
# the first 10 s, 1.1 in the next and 0.7 in the third, and a 64-token text's forward pass took
# p90 25.5 ms in the first, 18.8 in the third. So a server is warmed at each shape the benchmark
# measures, for this long each.
WARMUP_SECONDS = {64: 10.0, 1: 15.0}


def warm_up(url: str, headers: dict[str, str], texts: Sequence[str], token_counts: Sequence[int],
            seconds: dict[int, float] = WARMUP_SECONDS) -> None:
    """Uncounted load, one text per request, at each concurrency in `seconds` for its time."""
    for concurrency, duration in seconds.items():
        run_load(url, headers, texts, token_counts, concurrency=concurrency, texts_per_request=1, seconds=duration)


def run_load(url: str, headers: dict[str, str], texts: Sequence[str], token_counts: Sequence[int], *,
             concurrency: int, texts_per_request: int, seconds: float, warmup_seconds: float = 2.0,
             body: Callable[[list[str]], Any] | None = None) -> LoadResult:
    """`body`: a request's JSON body from its texts (default: `{"input": texts}`), called once for
    each distinct request of the corpus."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"load tests target loopback only, not {parts.hostname}")
    head = (f"POST {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: application/json\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()))
    requests = PreparedRequests(head.encode("latin-1"), texts, token_counts, texts_per_request,
                                body or (lambda batch: {"input": batch}))
    return asyncio.run(_run((parts.hostname, parts.port or 80), requests, concurrency, seconds, warmup_seconds))


class PreparedRequests:
    """The corpus cut into requests in order, round-robin, so every run sees the same mix; each
    request's bytes are written once, the first time it is sent."""

    def __init__(self, head: bytes, texts: Sequence[str], token_counts: Sequence[int], per_request: int,
                 body: Callable[[list[str]], Any]) -> None:
        self.head, self.body, self.per_request = head, body, per_request
        self.chunks = [(list(texts[i : i + per_request]), sum(token_counts[i : i + per_request]))
                       for i in range(0, len(texts) - per_request + 1, per_request)]
        self.encoded: list[bytes | None] = [None] * len(self.chunks)
        self.turn = 0

    def next(self) -> tuple[bytes, int, int]:
        """The next request: its bytes, texts and tokens."""
        index = self.turn
        self.turn = (index + 1) % len(self.chunks)
        batch, tokens = self.chunks[index]
        request = self.encoded[index]
        if request is None:
            payload = json.dumps(self.body(batch)).encode()
            request = self.encoded[index] = self.head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload
        return request, len(batch), tokens


class HttpConnection(asyncio.Protocol):
    """One client's keep-alive HTTP/1.1 connection: one request at a time, whose future resolves
    with the answer's status once the whole answer is in (by Content-Length, chunks, or the
    server closing)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.answer: Answer | None = None  # the head of the answer coming in
        self.closed = False

    def send(self, request: bytes) -> asyncio.Future:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.answer is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self.answer = Answer.parse(bytes(self.buffer[:end]), end + 4)
        end = self.answer.end(self.buffer)
        if end is not None:
            self._resolve(end)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.answer is not None and self.answer.length == UNTIL_CLOSE:
            self._resolve(len(self.buffer))
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"the server closed the connection before its answer ({exc})"))

    def _resolve(self, end: int) -> None:
        status, closes = self.answer.status, self.answer.closes
        del self.buffer[:end]
        self.answer = None
        if closes:
            self.transport.close()
            self.closed = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(status)


CHUNKED, UNTIL_CLOSE = -1, -2  # Answer.length when the head gives no Content-Length


@dataclass(frozen=True)
class Answer:
    """An HTTP answer's head: its status, where its body starts and how long it is."""
    status: int
    body_start: int
    length: int
    closes: bool

    @classmethod
    def parse(cls, head: bytes, body_start: int) -> "Answer":
        status_line, *lines = head.split(b"\r\n")
        fields = {}
        for line in lines:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip().lower()
        version, code = status_line.split(b" ", 2)[:2]
        status = int(code)
        if b"chunked" in fields.get(b"transfer-encoding", b""):
            length = CHUNKED
        elif b"content-length" in fields:
            length = int(fields[b"content-length"])
        else:
            length = 0 if status in (204, 304) or 100 <= status < 200 else UNTIL_CLOSE
        closes = fields.get(b"connection") == b"close" or (version == b"HTTP/1.0" and fields.get(b"connection") != b"keep-alive")
        return cls(status, body_start, length, closes or length == UNTIL_CLOSE)

    def end(self, buffer: bytearray) -> int | None:
        """Where the answer ends in `buffer`, or None while it is not all in."""
        if self.length >= 0:
            end = self.body_start + self.length
            return end if len(buffer) >= end else None
        if self.length == UNTIL_CLOSE:
            return None
        position = self.body_start
        while True:  # chunks: a hexadecimal size line, that many bytes, CRLF; size 0 then trailers
            line_end = buffer.find(b"\r\n", position)
            if line_end < 0:
                return None
            size = int(bytes(buffer[position:line_end]).split(b";")[0], 16)
            position = line_end + 2
            if size == 0:
                break
            position += size + 2
        while True:
            line_end = buffer.find(b"\r\n", position)
            if line_end < 0:
                return None
            if line_end == position:
                return line_end + 2
            position = line_end + 2


REQUEST_TIMEOUT_S = 600.0


async def _run(address: tuple[str, int], requests: PreparedRequests, concurrency: int, seconds: float,
               warmup: float) -> LoadResult:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors: dict[int, int] = {}
    counted = {"requests": 0, "texts": 0, "tokens": 0}
    connections: list[HttpConnection | None] = [None] * concurrency  # one a client, kept across phases

    def timed_out(waiter: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError(f"no answer within {REQUEST_TIMEOUT_S:.0f} s"))

    async def send(slot: int, measured: bool) -> None:
        request, texts, tokens = requests.next()
        connection = connections[slot]
        if connection is None or connection.closed:
            _, connection = await loop.create_connection(HttpConnection, *address)
            connections[slot] = connection
        sent = time.perf_counter()
        waiter = connection.send(request)
        timer = loop.call_later(REQUEST_TIMEOUT_S, timed_out, waiter)
        try:
            status = await waiter
        finally:
            timer.cancel()
        if not measured:
            return
        if status != 200:
            errors[status] = errors.get(status, 0) + 1
            return
        latencies.append((time.perf_counter() - sent) * 1000)
        counted["requests"] += 1
        counted["texts"] += texts
        counted["tokens"] += tokens

    async def client(slot: int, until: float, measured: bool) -> None:
        await send(slot, measured)  # at least one request each, however long it takes
        while time.perf_counter() < until:
            await send(slot, measured)

    try:
        warm_until = time.perf_counter() + warmup
        await asyncio.gather(*(client(slot, warm_until, False) for slot in range(concurrency)))
        # Measured phase: clients stop sending after `seconds`; everything sent is awaited and
        # counted, so the elapsed time covers every counted text.
        started = time.perf_counter()
        await asyncio.gather(*(client(slot, started + seconds, True) for slot in range(concurrency)))
        elapsed = time.perf_counter() - started
    finally:
        for connection in connections:
            if connection is not None and not connection.closed:
                connection.transport.close()
    return LoadResult(concurrency, requests.per_request, elapsed, counted["requests"], counted["texts"],
                      counted["tokens"], errors, latencies)
