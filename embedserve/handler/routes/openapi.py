"""The OpenAPI 3.1 document of the routes a worker serves, assembled from what the route families
declare (each RouteSpec's operations, each family's schemas) and the pieces they share
(routes/schema.py: the error kinds, the embed task's option table, the limits, the server's
profile): nothing is written twice, so the document cannot drift from what the handler does. The
service serves it at <model>/<version>/openapi.json; docs/api.md is the same facts for people.
"""

from __future__ import annotations

from typing import Any

from embedserve.handler.api.route import Route
from embedserve.handler.api.server import ServerProfile
from embedserve.handler.routes import cohere, hybrid, multi_vector, openai, sparse, tei
from embedserve.handler.routes.schema import ServedModel, common_schemas, limits
from embedserve.handler.routes.table import spec_for

# The families that declare schemas (the native route's are OpenAI's and TEI's).
FAMILIES = (openai, tei, cohere, sparse, hybrid, multi_vector)


def service_document(service: Any, server: ServerProfile, version: str) -> dict[str, Any]:
    """The document of a service's routes, with its model's real values and limits."""
    text = service.text
    return openapi_document(ServedModel(
        name=service.model_name, version=version, dimension=text.checks.dimension, max_length=text.max_length,
        vocab_size=text.tokenizer.vocab_size, prompts=tuple(sorted(text.prompts)), settings=service.settings,
        max_tokens_per_request=service.max_request_tokens, max_chunk_overlap=text.max_chunk_overlap,
        span_pooling=text.pools_spans, reads_images=(text.images or getattr(service.work, "images", None)) is not None, task=service.task,
        labels=getattr(service.work, "labels", ()), instructed=getattr(service.work, "chat_pairs", None) is not None,
        server=server))


def paths(model: ServedModel) -> dict[str, Any]:
    """Each route the model serves (its task's, and those every model answers) at its URL."""
    server = model.server
    base, versioned = server.model_url(model.name), server.versioned_url(model.name, model.version)
    served = {route: spec for route in Route if (spec := spec_for(route, model.task)) is not None}
    return {base if route is Route.NATIVE else f"{versioned}/{route.value}": spec.operations(model)
            for route, spec in served.items()}


def openapi_document(model: ServedModel) -> dict[str, Any]:
    server = model.server
    bound = limits(model)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"embedserve: {model.name}",
            "version": model.version,
            "description": (
                f"Text embeddings of the model `{model.name}` (dimension {model.dimension}, at most "
                f"{model.max_length} tokens an input) on {server.name}. Every call sends {server.auth}. "
                "Limits: " + ", ".join(f"{key} {value}" for key, value in bound.items()) +
                ". Any other path after the version answers 404 (`not_found`)." +
                (f" {server.note}" if server.note else "")),
            "x-limits": bound,
        },
        "security": [{"bearerAuth": []}],
        "paths": paths(model),
        "components": {
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": server.auth}},
            "schemas": {**common_schemas(model),
                        **{name: schema for family in FAMILIES for name, schema in family.schemas(model).items()}},
        },
    }
