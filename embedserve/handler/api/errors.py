"""Typed request errors: each knows its HTTP status and renders itself in the route's error shape.

Every error is of one kind (KINDS, below), which fixes its status, its OpenAI `code` and its TEI
status and `error_type`. KINDS is the source of truth: the OpenAPI document (openapi.py) lists it,
and the table for people is docs/api.md's "Errors" section, which tests/unit/test_docs_errors.py
holds to KINDS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ErrorKind:
    code: str  # OpenAI shape: error.code
    status: int  # native and OpenAI routes
    tei_status: int  # TEI routes
    tei_type: str  # TEI shape: error_type
    meaning: str  # for the OpenAPI document and docs/api.md

    @property
    def error_type(self) -> str:
        """OpenAI shape: error.type."""
        return "server_error" if self.status >= 500 else "invalid_request_error"


MALFORMED = ErrorKind("invalid_request", 400, 400, "Validation",
                      "malformed: invalid JSON or UTF-8, a missing field, a wrong type, an unknown option value")
EMPTY = ErrorKind("empty_input", 400, 400, "Empty", "an empty string or list")
UNPROCESSABLE = ErrorKind("invalid_value", 400, 422, "Validation",
                          "valid JSON the model cannot take: unknown prompt_name, dimensions above the model's, "
                          "token ids outside the vocabulary, int8/uint8 without normalization")
NOT_FOUND = ErrorKind("not_found", 404, 404, "Validation", "unknown route after <model>/<version>/ in the URL")
METHOD_NOT_ALLOWED = ErrorKind("method_not_allowed", 405, 405, "Validation",
                               "a request without a body or content type, as a GET sends: the route takes POST")
TOO_LARGE = ErrorKind("too_large", 413, 413, "Validation", "over a limit (the message names it)")
INTERNAL = ErrorKind("internal_error", 500, 500, "Backend",
                     "an unexpected failure for this request, or a non-finite vector (logged; never served)")
OVERLOADED = ErrorKind("overloaded", 503, 429, "Overloaded",
                       "the batch's work budget is full; retry (retry-after: 1)")
UNAVAILABLE = ErrorKind("unavailable", 503, 503, "Unhealthy",
                        "the worker's device failed and the worker is being replaced; retry (retry-after: 1)")
OUT_OF_MEMORY = ErrorKind("out_of_memory", 507, 507, "Backend", "one input does not fit in memory even alone")

KINDS = (MALFORMED, EMPTY, UNPROCESSABLE, NOT_FOUND, METHOD_NOT_ALLOWED, TOO_LARGE, INTERNAL, OVERLOADED,
         UNAVAILABLE, OUT_OF_MEMORY)


# A message or param quotes the request (a key, a value, a prompt name) only this far, so an
# error never echoes megabytes back: the answer must stay under the server's largest answer.
MAX_QUOTE_CHARS = 4096


class RequestError(Exception):
    """The fault of one request. It fails that request alone, never its batch."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None):
        message = _clip(message)
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = None if param is None else _clip(param)
        # Set once the route is known: TEI routes answer in TEI's shape and statuses.
        self.tei = False

    @property
    def status(self) -> int:
        return self.kind.status

    @property
    def http_status(self) -> int:
        return self.kind.tei_status if self.tei else self.kind.status

    def body(self) -> dict[str, Any]:
        if self.tei:
            return {"error": self.message, "error_type": self.kind.tei_type}
        return {"error": {"message": self.message, "type": self.kind.error_type, "param": self.param,
                          "code": self.kind.code}}


def _clip(text: str) -> str:
    return text if len(text) <= MAX_QUOTE_CHARS else text[:MAX_QUOTE_CHARS] + "... (cut)"


def malformed(message: str, param: str | None = None) -> RequestError:
    return RequestError(MALFORMED, message, param)


def empty(message: str, param: str | None = None) -> RequestError:
    return RequestError(EMPTY, message, param)


def unprocessable(message: str, param: str | None = None) -> RequestError:
    return RequestError(UNPROCESSABLE, message, param)


def too_large(message: str, param: str | None = None) -> RequestError:
    return RequestError(TOO_LARGE, message, param)


def not_found(message: str) -> RequestError:
    return RequestError(NOT_FOUND, message)


def method_not_allowed(message: str) -> RequestError:
    return RequestError(METHOD_NOT_ALLOWED, message)


def out_of_memory(message: str, param: str | None = None) -> RequestError:
    return RequestError(OUT_OF_MEMORY, message, param)


def unavailable(message: str) -> RequestError:
    return RequestError(UNAVAILABLE, message)


def internal_error(message: str = "the server failed to prepare this request; the failure is logged",
                   param: str | None = None) -> RequestError:
    return RequestError(INTERNAL, message, param)


def overloaded(message: str) -> RequestError:
    return RequestError(OVERLOADED, message)
