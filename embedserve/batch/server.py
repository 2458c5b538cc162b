"""Where the service is, and what it accepts: the routes of one model, the limits its /info
reports and, where the management API is reachable, its workers and TorchServe batch size."""

from __future__ import annotations

from dataclasses import dataclass


class JobError(RuntimeError):
    """A failure of the whole job (server unreachable after retries, key refused, bad input): the
    command stops, keeps what it wrote, and exits non-zero; a rerun continues from there."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8080
    model: str
    version: str = "1.0"

    def route(self, path: str) -> str:
        """`path` of the model, e.g. "v1/embeddings" -> .../predictions/<model>/<version>/v1/embeddings."""
        return f"{self.url.rstrip('/')}/predictions/{self.model}/{self.version}/{path.lstrip('/')}"


@dataclass(frozen=True)
class Limits:
    """The per-request limits of /info (docs/api.md, Limits) that grouping must respect."""

    task: str  # "embed", "rerank" or "classify"
    dimension: int
    max_inputs: int  # max_client_batch_size, the handler's max_inputs_per_request
    max_input_chars: int
    max_input_length: int  # tokens an input keeps after truncation
    max_tokens_per_request: int
    max_batch_work_tokens: int  # tokens one TorchServe batch may hold before requests get 503
    max_response_bytes: int

    @classmethod
    def from_info(cls, info: dict) -> "Limits":
        try:
            return cls(
                task=str(info.get("task", "embed")),
                dimension=int(info.get("embedding_dimension") or 0),
                max_inputs=int(info["max_client_batch_size"]),
                max_input_chars=int(info["max_input_chars"]),
                max_input_length=int(info["max_input_length"]),
                max_tokens_per_request=int(info["max_tokens_per_request"]),
                max_batch_work_tokens=int(info.get("max_batch_work_tokens") or info["max_tokens_per_request"]),
                max_response_bytes=int(info["max_response_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise JobError(f"the server's /info lacks a limit this command needs ({err}); is it an embedserve "
                           "server?") from None


@dataclass(frozen=True)
class Capacity:
    """How many requests TorchServe works on at once: from the management API when given."""

    workers: int
    batch_size: int

    @classmethod
    def from_management(cls, description: list | dict) -> "Capacity":
        entry = description[0] if isinstance(description, list) else description
        workers = sum(1 for w in entry.get("workers", []) if w.get("status") == "READY") or entry["minWorkers"]
        return cls(workers=max(1, int(workers)), batch_size=max(1, int(entry["batchSize"])))


# Requests in flight when the management API is not given: enough for a few workers on a server
# (or replicas behind a Service), few enough that their texts stay within one batch's work bound.
DEFAULT_TABLE_CONCURRENCY = 8
DEFAULT_LINE_CONCURRENCY = 64


def concurrency(capacity: Capacity | None, grouped: bool) -> int:
    """Requests to keep in flight. Grouped table requests are large: two per worker keep each
    worker busy (one runs, one waits). Batch-file lines are usually small: enough to fill each
    worker's TorchServe batch twice over, so batches are full while the previous ones run."""
    if capacity is None:
        return DEFAULT_TABLE_CONCURRENCY if grouped else DEFAULT_LINE_CONCURRENCY
    if grouped:
        return max(2, 2 * capacity.workers)
    return max(2, 2 * capacity.workers * capacity.batch_size)
