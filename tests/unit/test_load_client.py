"""bench/load.py's HTTP client against a loopback server that answers in each of HTTP/1.1's
framings, a few bytes at a time: what it counts, and that it reads each answer whole."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from contextlib import contextmanager

import pytest

from bench.load import run_load

BODY = b'{"data": [1, 2, 3]}'


def content_length(status: int) -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status, len(BODY), BODY)


def chunked() -> bytes:
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\n" + BODY[:5] + b"\r\n" + b"%x\r\n" % (len(BODY) - 5) + BODY[5:] + b"\r\n"
            b"0\r\nX-Trailer: 1\r\n\r\n")


def until_close() -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + BODY


def closing() -> bytes:
    return b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


@contextmanager
def loopback_server(answer, piece: int = 7):
    """A server answering each request with `answer(request_body)`, written `piece` bytes at a
    time; it closes the connection after answers that end by closing. Yields (url, bodies seen)."""
    seen: list[dict] = []
    ready = threading.Event()
    box: dict = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
                body = json.loads(await reader.readexactly(int(fields[b"Content-Length"])))
                seen.append({"body": body, "authorization": fields.get(b"Authorization")})
                data = answer(body)
                for start in range(0, len(data), piece):
                    writer.write(data[start : start + piece])
                    await writer.drain()
                    await asyncio.sleep(0)
                if b"Content-Length" not in data and b"chunked" not in data or b"Connection: close" in data:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def serve() -> None:
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
        box.update(loop=loop, port=server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()
        server.close()
        loop.run_until_complete(server.wait_closed())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield f"http://127.0.0.1:{box['port']}/predictions/m?x=1", seen
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        thread.join(10)


@pytest.mark.parametrize("framing", [lambda body: content_length(200), lambda body: chunked(),
                                     lambda body: until_close(), lambda body: closing()],
                         ids=["content-length", "chunked", "until-close", "connection-close"])
def test_each_framing_is_read_whole_and_counted(framing):
    with loopback_server(framing) as (url, seen):
        result = run_load(url, {"Authorization": "Bearer k"}, ["a", "b", "c", "d"], [3, 4, 5, 6], concurrency=2,
                          texts_per_request=2, seconds=0.3, warmup_seconds=0.1)
    assert result.errors == {} and result.requests >= 2
    assert result.texts == 2 * result.requests
    # Requests are cut in order, round-robin: [a, b] (7 tokens) and [c, d] (11).
    assert result.tokens in (9 * result.requests - 2, 9 * result.requests, 9 * result.requests + 2)
    assert {tuple(s["body"]["input"]) for s in seen} == {("a", "b"), ("c", "d")}
    assert {s["authorization"] for s in seen} == {b"Bearer k"}
    assert len(result.latencies_ms) == result.requests


def test_answers_other_than_200_are_counted_as_errors_by_status():
    statuses = itertools.cycle([200, 503])
    with loopback_server(lambda body: content_length(next(statuses)), piece=1000) as (url, _):
        result = run_load(url, {}, ["a"], [1], concurrency=1, texts_per_request=1, seconds=0.2, warmup_seconds=0.0)
    assert set(result.errors) == {503} and result.errors[503] in (result.requests, result.requests + 1)


def test_the_body_is_built_once_for_each_request_of_the_corpus():
    calls = []
    with loopback_server(lambda body: content_length(200)) as (url, seen):
        run_load(url, {}, ["a", "b", "c"], [1, 1, 1], concurrency=3, texts_per_request=1, seconds=0.2,
                 warmup_seconds=0.0, body=lambda batch: calls.append(batch) or {"inputs": batch})
    assert sorted(map(tuple, calls)) == [("a",), ("b",), ("c",)] and len(seen) > 3
    assert {s["body"]["inputs"][0] for s in seen} == {"a", "b", "c"}


def test_a_server_that_closes_before_answering_fails_the_run():
    with loopback_server(lambda body: b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\nshort") as (url, _):
        with pytest.raises(ConnectionError, match="closed the connection"):
            run_load(url, {}, ["a"], [1], concurrency=1, texts_per_request=1, seconds=0.1, warmup_seconds=0.0)
