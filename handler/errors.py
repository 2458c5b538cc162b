"""Typed request errors: each carries its HTTP status and renders its own JSON body."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """The fault of one request. It fails that request alone, never its batch."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


def not_found(message: str) -> RequestError:
    return RequestError(404, message, code="not_found")
