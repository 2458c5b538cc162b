"""Overload and worker faults against the real TorchServe: every request gets an answer.

One isolated server for the module, with a deliberately small job queue, serving the tiny model
twice: `tiny` (1 worker, batches of 4, 50 ms delay) for overload and kill -9, and `slowfill`
(1 worker, a 3 s batch delay) to hold a worker inside TorchServe's batch assembly.
"""

import asyncio
import json
import os
import signal
import statistics
import time
from dataclasses import dataclass

import aiohttp
import pytest
import requests

from embedserve.archive.corpus import fixed_corpus
from bench.load import run_load
from bench.recovery import model_workers, wait_replaced
from embedserve.scripts.serverctl import TorchServe
from tests.support.serving import serving

pytestmark = pytest.mark.integration

JOB_QUEUE_SIZE = 8
BATCH_SIZE = 4
RESPONSE_TIMEOUT_S = 20  # TorchServe's per-batch limit, and the answer time every request must meet
BURST_CLIENTS = 8 * JOB_QUEUE_SIZE
BURST_SECONDS = 5.0
# After the burst, half the baseline throughput again within this. A stuck server never gets there;
# the suite's other worker can hold every window of a shared machine back for a while (a fresh-clone
# run: no 2-second window at half a 551 requests/s baseline within 15 s; the test alone: 2.5 s).
THROUGHPUT_BACK_WITHIN_S = 45.0
RECOVERY_BUDGET_S = 60.0  # a worker restart is 5-20 s here, longer on a contended machine
SLOW_FILL_DELAY_MS = 3000
TEXT_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tiny = ["--model", str(tiny_model_dir), "--name", "tiny", "--workers", "1", "--batch-size", str(BATCH_SIZE),
            "--max-batch-delay", "50", "--response-timeout", str(RESPONSE_TIMEOUT_S)]
    slowfill = ["--model", str(tiny_model_dir), "--name", "slowfill", "--workers", "1", "--batch-size", "8",
                "--max-batch-delay", str(SLOW_FILL_DELAY_MS), "--response-timeout", str(RESPONSE_TIMEOUT_S)]
    with serving(tmp_path_factory.mktemp("resilience"), tiny, slowfill, job_queue_size=str(JOB_QUEUE_SIZE)) as ts:
        yield ts


@pytest.fixture(scope="module")
def texts(tiny_model_dir):
    return fixed_corpus(tiny_model_dir / "tokenizer.json", 256, length=TEXT_TOKENS)


@dataclass
class Answer:
    sent: float  # time.monotonic()
    done: float
    status: int | str  # HTTP status, or the exception's name when no response came
    well_formed: bool  # 200: one embedding per text; otherwise: a JSON error body

    @property
    def latency(self) -> float:
        return self.done - self.sent


async def post(session: aiohttp.ClientSession, url: str, headers: dict, batch: list[str]) -> Answer:
    sent = time.monotonic()
    try:
        async with session.post(url, json={"input": batch}, headers=headers) as response:
            body = await response.read()
            status = response.status
    except (TimeoutError, aiohttp.ClientError) as err:
        return Answer(sent, time.monotonic(), type(err).__name__, False)
    try:
        parsed = json.loads(body)
        well_formed = len(parsed["data"]) == len(batch) if status == 200 else isinstance(parsed, dict)
    except (ValueError, KeyError, TypeError):
        well_formed = False
    return Answer(sent, time.monotonic(), status, well_formed)


async def closed_loop(url: str, headers: dict, texts: list[str], clients: int, until, answers: list[Answer],
                      per_request: int = 2, timeout: float = RESPONSE_TIMEOUT_S) -> int:
    """`clients` clients each sending its next request as soon as the last is answered, while
    `until()` is false. Appends every answer to `answers` as it comes; returns how many were sent."""
    sent = 0

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal sent
        i = k
        while not until():
            sent += 1
            answers.append(await post(session, url, headers, texts[i % len(texts): i % len(texts) + per_request]))
            i += clients

    connector = aiohttp.TCPConnector(limit=0)  # no client-side queueing: every request reaches the server
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        await asyncio.gather(*(client(session, k) for k in range(clients)))
    return sent


def requests_per_s(server: TorchServe, texts: list[str], seconds: float) -> float:
    result = run_load(f"{server.url('inference')}/predictions/tiny", server.auth(), texts, [TEXT_TOKENS] * len(texts),
                      concurrency=2 * BATCH_SIZE, texts_per_request=2, seconds=seconds, warmup_seconds=0.5)
    assert result.errors == {}, result.errors
    return result.requests / result.seconds


def seconds_until_throughput(server: TorchServe, texts: list[str], target: float,
                             limit: float = THROUGHPUT_BACK_WITHIN_S) -> float:
    """Seconds until a 2-second window reaches `target` requests/s. Other processes share the
    cores, so one window can be slow for reasons of theirs: the best window within `limit` counts."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if requests_per_s(server, texts, 2.0) >= target:
            return time.monotonic() - started
    return float("inf")


def test_overload_gets_fast_503s_never_a_hang_and_throughput_comes_back(server, texts, record_property):
    baseline = requests_per_s(server, texts, 3.0)
    end, answers = time.monotonic() + BURST_SECONDS, []
    sent = asyncio.run(closed_loop(f"{server.url('inference')}/predictions/tiny", server.auth(), texts,
                                   BURST_CLIENTS, until=lambda: time.monotonic() > end, answers=answers))
    back_after = seconds_until_throughput(server, texts, 0.5 * baseline)

    statuses = [a.status for a in answers]
    counts = {s: statuses.count(s) for s in set(statuses)}
    refused = [a.latency for a in answers if a.status == 503]
    figures = {"sent": sent, "answered": sum(isinstance(s, int) for s in statuses), "statuses": counts,
               "max_latency_s": round(max(a.latency for a in answers), 3),
               "median_503_s": round(statistics.median(refused), 3) if refused else None,
               "baseline_rps": round(baseline, 1), "half_baseline_after_s": round(back_after, 1)}
    print(figures)
    record_property("overload", figures)

    assert figures["answered"] == sent == len(answers), figures  # nothing dropped, no client timeout
    assert set(counts) <= {200, 429, 503}, figures
    assert counts.get(200) and counts.get(503), f"the burst did not overload the queue: {figures}"
    assert all(a.well_formed for a in answers), "a 200 without one embedding per text, or an error without JSON"
    assert figures["max_latency_s"] < RESPONSE_TIMEOUT_S, figures
    assert figures["median_503_s"] < 1.0, f"refusals are not fast: {figures}"
    assert back_after < THROUGHPUT_BACK_WITHIN_S, f"throughput did not come back after the burst: {figures}"


def test_kill_9_during_load_errors_the_in_flight_batch_and_the_model_recovers(server, texts, record_property):
    url, headers = f"{server.url('inference')}/predictions/tiny", server.auth()
    [worker] = model_workers(server, "tiny")
    # A request of 4096 texts of the tiny model's full length keeps the single worker busy for
    # seconds. Timed alone first, it is killed halfway through: the kill then lands while a batch
    # is inside the worker, not while TorchServe is still filling one (see the expected failure below).
    big_batch = [" ".join(texts[:4])] * 4096
    started = time.monotonic()
    assert requests.post(url, json={"input": big_batch}, headers=headers, timeout=RECOVERY_BUDGET_S).status_code == 200
    kill_after = (time.monotonic() - started) / 2

    async def scenario():
        answers: list[Answer] = []
        stop_at = [float("inf")]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RECOVERY_BUDGET_S)) as session:
            big = asyncio.create_task(post(session, url, headers, big_batch))
            loading = asyncio.create_task(closed_loop(url, headers, texts, 4, lambda: time.monotonic() > stop_at[0],
                                                      answers, timeout=RECOVERY_BUDGET_S))
            await asyncio.sleep(kill_after)
            killed_at = time.monotonic()
            os.kill(worker["pid"], signal.SIGKILL)
            # Recovered: the first embedding answered to a request sent after the kill.
            recovered_at = None
            while recovered_at is None and time.monotonic() < killed_at + RECOVERY_BUDGET_S:
                recovered_at = min((a.done for a in answers if a.sent >= killed_at and a.status == 200), default=None)
                await asyncio.sleep(0.05)
            stop_at[0] = time.monotonic() + 1.0  # a little more load on the new worker
            sent = await loading
            return killed_at, recovered_at, await big, sent, answers

    killed_at, recovered_at, big, sent, answers = asyncio.run(scenario())
    [replaced] = model_workers(server, "tiny")
    statuses = [a.status for a in answers]
    assert recovered_at is not None, f"no embedding within {RECOVERY_BUDGET_S} s of the kill"
    figures = {"recovery_s": round(recovered_at - killed_at, 2), "kill_after_s": round(kill_after, 2),
               "big_request": big.status, "sent": sent,
               "statuses": {s: statuses.count(s) for s in set(statuses)},
               "max_latency_s": round(max(a.latency for a in answers), 2),
               "worker": {"id": worker["id"], "pid": worker["pid"]},
               "replaced_by": {"id": replaced["id"], "pid": replaced["pid"], "status": replaced["status"]}}
    print(figures)
    record_property("kill_9", figures)

    assert big.status in (500, 507) and big.well_formed, figures  # TorchServe: "Worker died."
    assert all(isinstance(s, int) for s in statuses), f"a request got no answer: {figures}"
    assert set(statuses) <= {200, 500, 503, 507} and all(a.well_formed for a in answers), figures
    assert replaced["pid"] != worker["pid"] and replaced["status"] == "READY", figures
    assert len(answers) == sent, figures


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "TorchServe 0.12 drops requests a worker had taken into a batch that was still filling "
    "(maxBatchDelay) when the worker died: WorkerThread.run's finally clears them "
    "(BatchAggregator.cleanJobs) without a response, and the client waits forever. "
    "See docs/operations.md. Strict: if TorchServe starts answering them, this passes and fails the run."))
def test_kill_9_while_a_batch_fills_still_answers_its_requests(server, texts):
    url, headers = f"{server.url('inference')}/predictions/slowfill", server.auth()
    [worker] = model_workers(server, "slowfill")

    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RECOVERY_BUDGET_S)) as session:
            waiting = [asyncio.create_task(post(session, url, headers, texts[i:i + 1])) for i in range(3)]
            # Half the batch delay: the worker has taken the three requests and waits for more.
            await asyncio.sleep(SLOW_FILL_DELAY_MS / 2000)
            os.kill(worker["pid"], signal.SIGKILL)
            await asyncio.to_thread(wait_replaced, server, "slowfill", {worker["pid"]}, 1, RECOVERY_BUDGET_S)
            fresh = await post(session, url, headers, texts[:1])
            await asyncio.sleep(2.0)
            answered = [task.done() for task in waiting]
            for task in waiting:
                task.cancel()
            return fresh, answered

    fresh, answered = asyncio.run(scenario())
    if fresh.status != 200:  # pytest.fail, not assert: only the lost requests may make the expected failure
        pytest.fail(f"the model did not serve again after the restart: {fresh.status}")
    assert all(answered), f"{answered.count(False)} of 3 requests never got a response after kill -9"
