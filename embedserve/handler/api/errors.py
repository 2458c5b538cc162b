"""Typed request errors: each knows its HTTP status and renders itself in the route's error shape.

Statuses, the same on every route except where noted:
  400  malformed: invalid JSON or UTF-8, wrong types, empty input
  404  unknown route
  413  over a size limit: inputs per request, characters per input, tokens
  422  valid JSON that cannot be processed (unknown prompt, dimensions out of range, token ids
       outside the vocabulary, ...) on the TEI routes, as TEI answers; 400 on the others
  500  an unexpected failure preparing, embedding or encoding one request, or a non-finite
       vector (logged; the rest of its batch is served)
  503  the batch's work budget is full (429 on TEI routes), or the worker's device failed and
       the worker is being replaced: a retry succeeds
  507  an input that does not fit in memory even alone (a larger batch is split and retried)
"""

from __future__ import annotations

from typing import Any



class RequestError(Exception):
    """The fault of one request. It fails that request alone, never its batch."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_value",
                 tei_status: int | None = None, tei_type: str = "Validation"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.tei_status = tei_status or status
        self.tei_type = tei_type
        # Set once the route is known: TEI routes answer in TEI's shape and statuses.
        self.tei = False

    @property
    def http_status(self) -> int:
        return self.tei_status if self.tei else self.status

    def body(self) -> dict[str, Any]:
        if self.tei:
            return {"error": self.message, "error_type": self.tei_type}
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def malformed(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_request")


def empty(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code="empty_input", tei_type="Empty")


def unprocessable(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value", tei_status=422)


def too_large(message: str, param: str | None = None) -> RequestError:
    return RequestError(413, message, param=param, code="too_large")


def not_found(message: str) -> RequestError:
    return RequestError(404, message, code="not_found")


def out_of_memory(message: str, param: str | None = None) -> RequestError:
    return RequestError(507, message, param=param, code="out_of_memory", tei_type="Backend")


def unavailable(message: str) -> RequestError:
    return RequestError(503, message, code="unavailable", tei_type="Unhealthy")


def internal_error(message: str = "the server failed to prepare this request; the failure is logged",
                   param: str | None = None) -> RequestError:
    return RequestError(500, message, param=param, code="internal_error", tei_type="Backend")


def overloaded(message: str) -> RequestError:
    return RequestError(503, message, code="overloaded", tei_status=429, tei_type="Overloaded")
