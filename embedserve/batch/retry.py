"""Which answers are worth sending again, and how long to wait first.

Embedding requests are idempotent, so every answer that says "not now" is retried: 429 and 503
(a full queue or work budget, a worker being replaced), 502/504 from a proxy in front, and
TorchServe's own 500/507 "Worker died." (its body is `{"code", "type", "message"}`, where the
handler's is `{"error": ...}`). The handler's 500 `internal_error` is this request's own
failure: sent once more, as docs/operations.md advises, then kept as the answer. Everything else
(400, 404, 413, 422, the handler's 507 out_of_memory) is the request's final answer.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

import orjson

RETRIED_STATUSES = frozenset({429, 502, 503, 504})


class Verdict(enum.Enum):
    FINAL = "final"  # the request's answer, kept whatever its status
    RETRY = "retry"  # send it again after a wait
    KEY_REFUSED = "key_refused"  # TorchServe refused the key: no request can succeed with it


def torchserve_error(body: bytes) -> dict | None:
    """TorchServe's own error body ({"code", "type", "message"}), or None for the handler's answers."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("code"), int) and "type" in parsed and "error" not in parsed:
        return parsed
    return None


def verdict(status: int, body: bytes, attempt: int) -> Verdict:
    """What to do with an answer to the `attempt`-th try (0 for the first)."""
    if status < 400:
        return Verdict.FINAL
    if status in RETRIED_STATUSES:
        return Verdict.RETRY
    own = torchserve_error(body)
    if status == 400 and own is not None and own.get("type") == "InvalidKeyException":
        return Verdict.KEY_REFUSED
    if status in (500, 507) and own is not None:
        return Verdict.RETRY  # the worker died under this batch; another worker (or its restart) serves it
    if status == 500 and attempt == 0:
        return Verdict.RETRY
    return Verdict.FINAL


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: the n-th wait is drawn from [cap/2, cap], cap = base x 2^n
    bounded by `most_s`, so clients that failed together spread out while the total wait before
    giving up stays predictable; never shorter than the server's Retry-After."""

    retries: int = 10  # retries of one request before the job stops (about 1.5-2.5 minutes of waits)
    base_s: float = 0.5
    most_s: float = 30.0

    def wait(self, retry: int, retry_after: str | None = None, rng: random.Random | None = None) -> float:
        cap = min(self.most_s, self.base_s * 2 ** retry)
        drawn = cap / 2 + (rng or random).uniform(0, cap / 2)
        return max(drawn, min(retry_after_seconds(retry_after), self.most_s))

    def total_bounds(self) -> tuple[float, float]:
        """The least and most time all retries of one request wait, Retry-After aside."""
        caps = [min(self.most_s, self.base_s * 2 ** n) for n in range(self.retries)]
        return sum(caps) / 2, sum(caps)


def retry_after_seconds(value: str | None) -> float:
    """Retry-After in seconds; its HTTP-date form, or anything unreadable, counts as 0."""
    try:
        return max(0.0, float(value)) if value is not None else 0.0
    except ValueError:
        return 0.0
