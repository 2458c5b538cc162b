"""A closed-loop HTTP load generator: N concurrent clients, each sending its next request as soon
as the previous one is answered, on loopback only.

A warm-up phase (at least one request per client) is not counted. In the measured phase clients
stop sending after the set time and every request sent is awaited, so throughput is all texts
answered over the whole elapsed time, and slow scenarios (many texts per request) still count.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import aiohttp
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
    """`body`: a request's JSON body from its texts (default: `{"input": texts}`)."""
    host = urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"load tests target loopback only, not {host}")
    return asyncio.run(_run(url, headers, texts, token_counts, concurrency, texts_per_request, seconds,
                            warmup_seconds, body or (lambda batch: {"input": batch})))


async def _run(url, headers, texts, token_counts, concurrency, per_request, seconds, warmup, body) -> LoadResult:
    # Requests are cut from the corpus in order, round-robin, so every run sees the same mix.
    chunks = itertools.cycle([(list(texts[i : i + per_request]), sum(token_counts[i : i + per_request]))
                              for i in range(0, len(texts) - per_request + 1, per_request)])
    latencies: list[float] = []
    errors: dict[int, int] = {}
    counted = {"requests": 0, "texts": 0, "tokens": 0}

    async def send(session: aiohttp.ClientSession, measured: bool) -> None:
        batch, tokens = next(chunks)
        sent = time.perf_counter()
        async with session.post(url, json=body(batch), headers=headers) as response:
            await response.read()
            status = response.status
        if not measured:
            return
        if status != 200:
            errors[status] = errors.get(status, 0) + 1
            return
        latencies.append((time.perf_counter() - sent) * 1000)
        counted["requests"] += 1
        counted["texts"] += len(batch)
        counted["tokens"] += tokens

    async def client(session: aiohttp.ClientSession, until: float, measured: bool) -> None:
        await send(session, measured)  # at least one request each, however long it takes
        while time.perf_counter() < until:
            await send(session, measured)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        warm_until = time.perf_counter() + warmup
        await asyncio.gather(*(client(session, warm_until, False) for _ in range(concurrency)))
        # Measured phase: clients stop sending after `seconds`; everything sent is awaited and
        # counted, so the elapsed time covers every counted text.
        started = time.perf_counter()
        await asyncio.gather(*(client(session, started + seconds, True) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return LoadResult(concurrency, per_request, elapsed, counted["requests"], counted["texts"], counted["tokens"],
                      errors, latencies)
