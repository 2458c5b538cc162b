"""What the HTTP server in front of the handler decides, told to the parts that describe the API.

The handler is server-agnostic: the server's adapter (embedserve/handler/torchserve/) gives the
service a ServerProfile, and the OpenAPI document takes its paths, its authentication and the
answers the server gives on its own (before or around the handler) from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerAnswer:
    """A status the server answers itself: when, and its body's schema (None: an empty body)."""
    status: int
    when: str
    schema: str | None = None


@dataclass(frozen=True)
class ServerProfile:
    name: str
    model_path: str  # a model's URL path, with "{model}" to fill in
    versioned_path: str  # with its version, "{model}" and "{version}" to fill in
    auth: str  # how a client sends its bearer key
    answers: tuple[ServerAnswer, ...] = ()
    error_schemas: dict[str, Any] = field(default_factory=dict)  # the schemas `answers` name
    note: str = ""  # what else a client should know, for the document's description

    def model_url(self, model: str) -> str:
        return self.model_path.format(model=model)

    def versioned_url(self, model: str, version: str) -> str:
        return self.versioned_path.format(model=model, version=version)


# A server that hands the handler every request as it came: no answers of its own.
PLAIN = ServerProfile(name="embedserve", model_path="/{model}", versioned_path="/{model}/{version}",
                      auth="a bearer key, where the server asks for one")
