"""Requests for the fuzz tests, each with the statuses it must get, and the volume run: 10,000
requests, good, bad and the largest shapes the limits allow, against a real TorchServe."""

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
import requests

MAX_INPUTS = 4096  # max_inputs_per_request
MAX_REQUEST_BYTES = 10 * 2**20  # over max_request_size, which the build sets to 8.5 MB for the defaults
ROUTES = {"": "input", "v1/embeddings": "input", "embed": "inputs"}
FRONTEND_413 = "over max_request_size"


@dataclass(frozen=True)
class Case:
    kind: str  # what was generated, for the tally
    body: bytes
    path: str = ""
    content_type: str = "application/json"
    inputs: int = 0  # good cases: how many embeddings the answer must hold
    statuses: frozenset = frozenset({200})

    def __repr__(self) -> str:  # short: some bodies are megabytes
        return f"Case({self.kind!r}, {self.body[:120]!r}{'...' if len(self.body) > 120 else ''}, path={self.path!r})"


def json_body(value) -> bytes:
    return json.dumps(value).encode()


def bad(kind: str, body, statuses=(400,), path: str = "", content_type: str = "application/json") -> Case:
    return Case(kind, body if isinstance(body, bytes) else json_body(body), path, content_type,
                statuses=frozenset(statuses))


def workers(server, model: str = "tiny") -> list[tuple]:
    [described] = requests.get(f"{server.url('management')}/models/{model}", headers=server.auth("management"),
                               timeout=30).json()
    return sorted((w["id"], w["pid"], w["startTime"]) for w in described["workers"])


VOLUME = 10_000
VOLUME_CONCURRENCY = 32


@dataclass(frozen=True)
class Served:
    """What the volume run needs to know of the model it targets."""
    name: str
    dimension: int
    vocab_size: int
    prompts: tuple[str, ...]


def volume_cases(rng: random.Random, count: int, model: Served) -> list[Case]:
    """`count` requests, half good, half bad of every kind, the largest shapes included."""
    words = ["hello", "world", "cat", "sat", "mat", "embedding", "vector", "é", "漢字", "🚀", "\x00", "\n"]

    def some_text(longest=12):
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, longest)))

    def good_case() -> Case:
        path = rng.choice(sorted(ROUTES))
        texts = [some_text() for _ in range(rng.randint(1, 4))]
        body = {ROUTES[path]: texts}
        if path != "embed" and rng.random() < 0.5:
            body["dimensions"] = rng.randint(1, model.dimension)
            body["encoding_format"] = rng.choice(["float", "base64"])
            body["truncation_direction"] = rng.choice(["right", "left"])
            if model.prompts:
                body["prompt_name"] = rng.choice(model.prompts)
        if path != "embed" and rng.random() < 0.2:
            body["input"] = [[rng.randrange(5, model.vocab_size) for _ in range(rng.randint(1, 30))]]
            return Case("good token ids", json_body(body), path, inputs=1)
        return Case("good", json_body(body), path, inputs=len(texts))

    makers = [
        lambda: bad("invalid JSON", rng.choice([b"{", b"[1,", b'{"input": }', b"\x00\x01", b"nul"])),
        lambda: bad("wrong type", {"input": rng.choice([1, 2.5, True, None, {"a": 1}])}),
        lambda: bad("wrong item type", {"input": ["fine", rng.choice([1, None, {"x": 2}])]}),
        lambda: bad("deeply nested", b"[" * 50_000 + b"]" * 50_000),
        lambda: bad("invalid UTF-8", b'{"input": "ok \xc3\x28"}'),
        lambda: bad("lone surrogate", b'{"input": "a\\udbffb"}'),
        lambda: bad("token id out of range", {"input": [[5, rng.randint(model.vocab_size, 2**40)]]}, (400, 422)),
        lambda: bad("negative token id", {"input": [[5, -rng.randint(1, 99)]]}),
        lambda: bad("absurd option", {"input": "x", "dimensions": rng.choice([0, -3, model.dimension + 1, "8"])}),
        lambda: bad("empty input", {"input": rng.choice(["", [], [""]])}),
        lambda: bad("unknown route", {"input": "x"}, (404,), rng.choice(["v2", "embeddings", "x-y"])),
        lambda: bad("too long, truncation off", {"input": ["embedding " * 600], "truncate": False}, (413,)),
        lambda: bad("too many inputs", {"input": ["x"] * (MAX_INPUTS + 1)}, (413,)),
        lambda: bad("form-encoded", b"input=hello", content_type="application/x-www-form-urlencoded"),
    ]
    largest = [
        lambda: Case("largest: most inputs", json_body({"input": [some_text() for _ in range(MAX_INPUTS)]}),
                     inputs=MAX_INPUTS),
        # The most tokens (300-token texts, cut at the max length) in a body under max_request_size:
        # answered, or refused with 413 where the worker's work bound is lower.
        lambda: Case("largest: most inputs, longest texts", json_body({"input": ["a " * 300] * MAX_INPUTS}),
                     inputs=MAX_INPUTS, statuses=frozenset({200, 413})),
        lambda: bad(FRONTEND_413, b'{"input": "' + b"a" * MAX_REQUEST_BYTES + b'"}', (413,)),
    ]
    cases = []
    for i in range(count):
        if i % 500 == 0:
            cases.append(largest[(i // 500) % len(largest)]())
        else:
            cases.append(good_case() if rng.random() < 0.5 else rng.choice(makers)())
    return cases


async def send_all(server, cases: list[Case], model: str) -> list[tuple[int, bytes]]:
    semaphore = asyncio.Semaphore(VOLUME_CONCURRENCY)
    headers = server.auth()

    async def one(session, case):
        url = f"{server.url('inference')}/predictions/{model}" + (f"/1.0/{case.path}" if case.path else "")
        async with semaphore:
            async with session.post(url, data=case.body, headers={"Content-Type": case.content_type, **headers},
                                    timeout=aiohttp.ClientTimeout(total=300)) as response:
                return response.status, await response.read()

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, case) for case in cases))


def run_volume(server, model: Served, seed: int = 14) -> dict:
    """Send VOLUME requests, bad, good and the largest shapes interleaved, and check that every one
    is answered with its own status (good ones 200 with one embedding per input) and that no
    worker restarted. Returns the tally."""
    before = workers(server, model.name)
    cases = volume_cases(random.Random(seed), VOLUME, model)
    started = time.monotonic()
    answers = asyncio.run(send_all(server, cases, model.name))
    seconds = time.monotonic() - started
    tally: Counter = Counter()
    for case, (status, body) in zip(cases, answers):
        assert status in case.statuses, (case, status, body[:300])
        if case.kind != FRONTEND_413:
            answer = json.loads(body)  # every answer is JSON
            if status == 200 and case.inputs:
                rows = answer if case.path == "embed" else answer["data"]
                assert len(rows) == case.inputs, case
        tally[(case.kind, status)] += 1
    assert workers(server, model.name) == before, "a worker restarted"
    good = sum(n for (kind, status), n in tally.items() if kind.startswith("good") and status == 200)
    return {"model": model.name, "requests": len(cases), "seconds": round(seconds, 1), "good_answered_200": good,
            "by_kind_and_status": {f"{kind} {status}": n for (kind, status), n in sorted(tally.items())}}
