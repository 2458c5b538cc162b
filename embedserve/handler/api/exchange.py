"""What the server's adapter hands the service and gets back: one RawRequest in, one Response out,
per request of a batch. The adapter only moves these to and from its wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from embedserve.handler.api.codec import ALLOWED_METHOD, encode_error
from embedserve.handler.api.errors import METHOD_NOT_ALLOWED, internal_error, unavailable

JSON = "application/json"
# Statuses a client should retry after a moment: a full work budget (429 on TEI routes), a worker
# being replaced.
RETRY_LATER = (429, 503)


@dataclass(frozen=True)
class RawRequest:
    body: Any
    content_type: str | None = None
    url_path: str | None = None  # the path after the model's version: "v1/embeddings"
    method: str | None = None  # None where the server does not say: served as a POST


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = JSON

    @classmethod
    def of(cls, status: int, body: bytes, content_type: str = JSON, **headers: str) -> "Response":
        """A response with the headers its status asks for: retry after a moment, or the method allowed."""
        if status in RETRY_LATER:
            headers["retry-after"] = "1"
        elif status == METHOD_NOT_ALLOWED.status:
            headers["allow"] = ALLOWED_METHOD
        return cls(status, body, headers, content_type)


def failed(raw_requests: Sequence[RawRequest]) -> list[Response]:
    """500 for every request: what a worker answers when a batch fails outside every guard."""
    body = encode_error(internal_error("the server failed to answer this batch; the failure is logged"))
    return [Response(500, body) for _ in raw_requests]


def unavailable_answers(raw_requests: Sequence[RawRequest], reason: str) -> list[Response]:
    """503 for every request: what a worker answers after its device failed."""
    body = encode_error(unavailable(f"{reason}; this worker is being replaced, retry the request"))
    return [Response.of(503, body) for _ in raw_requests]
