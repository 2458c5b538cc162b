"""A hybrid (bge-m3) model's routes: the embedding routes, whose bodies may ask for its sparse and
ColBERT outputs beside the dense vector, and TEI's /embed_sparse.

  "", "v1/embeddings"  the embedding body and options, and "outputs": ["dense", "sparse", "colbert"]
                       (any of them; default ["dense"], OpenAI's answer unchanged) with the sparse
                       options -> OpenAI's list, each item with "embedding" (dense),
                       "sparse_embedding" and "colbert_embedding" as asked
  "embed"              TEI's /embed: the dense vectors
  "embed_sparse"       TEI's /embed_sparse: the sparse vectors

With the `openai` client, `outputs` goes in `extra_body`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from embedserve.handler.api.errors import RequestError, malformed
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.routes import native, openai, sparse, tei
from embedserve.handler.routes.base import RouteSpec, embedding_request
from embedserve.handler.routes.openai import encode_vector, openai_list
from embedserve.handler.routes.schema import ServedModel, ref
from embedserve.handler.tasks.embed import EmbeddingRequest, Options, refuse_long_input
from embedserve.handler.tasks.hybrid import OUTPUTS, HybridRequest, HybridResult, hybrid_request, parse_outputs
from embedserve.handler.tasks.sparse import parse_sparse_options

HYBRID = frozenset({Task.HYBRID})


def _with_outputs(request: EmbeddingRequest, payload: dict[str, Any]) -> HybridRequest:
    refuse_long_input(payload, "hybrid")
    if request.route.tei:  # a TEI body on the native route is TEI's /embed: dense vectors
        if parse_outputs(payload.get("outputs")) != ("dense",):
            raise malformed("'outputs' does not apply to TEI's /embed, which answers dense vectors", param="outputs")
        return hybrid_request(request, ("dense",), parse_sparse_options({}))
    return hybrid_request(request, parse_outputs(payload.get("outputs")), parse_sparse_options(payload))


def parse_sparse(body: Any, content_type: str | None, method: str | None) -> HybridRequest:
    """TEI's /embed_sparse body, for the sparse output alone."""
    request = sparse.parse(Route.TEI_EMBED_SPARSE, body, content_type, method)
    options = request.options
    return HybridRequest(request.route, request.inputs, Options(truncate=options.truncate,
                         truncation_direction=options.truncation_direction, prompt_name=options.prompt_name),
                         ("sparse",), options, field=request.field)


def encode_list(request: HybridRequest, result: HybridResult, model_name: str) -> bytes:
    """OpenAI's list; each item has what the request asked for."""
    items = []
    for i in range(len(request.inputs)):
        item: dict[str, Any] = {"object": "embedding", "index": i}
        if result.dense is not None:
            item["embedding"] = encode_vector(result.dense.vectors[i], request)
        if result.sparse is not None:
            item["sparse_embedding"] = dict(zip(result.sparse.names[i], result.sparse.weights[i])) \
                if result.sparse.names is not None else \
                {"indices": result.sparse.ids[i], "values": result.sparse.weights[i]}
        if result.colbert is not None:
            item["colbert_embedding"] = encode_vector(result.colbert[i], request)  # (tokens, dimension)
        items.append(item)
    return openai_list(items, model_name, result.tokens)


def encode_dense(request: HybridRequest, result: HybridResult, model_name: str) -> bytes:
    return tei.encode_embeddings(request, result.dense, model_name)


def encode_sparse(request: HybridRequest, result: HybridResult, model_name: str) -> bytes:
    return sparse.encode_tei(request, result.sparse, model_name)


def _parse(route: Route, **kwargs: Any):
    def parse(body: Any, content_type: str | None, method: str | None) -> HybridRequest:
        try:
            return embedding_request(route, body, content_type, method, extend=_with_outputs, **kwargs)
        except RequestError as err:
            err.tei = err.tei or route.tei
            raise
    return parse


# --- the OpenAPI document: the embedding routes' operations, their bodies taking the outputs -------

def _outputs_schema(model: ServedModel) -> dict[str, Any]:
    return {"properties": {
        "outputs": {"anyOf": [{"type": "array", "items": {"enum": list(OUTPUTS)}, "minItems": 1, "uniqueItems": True},
                              {"enum": [*OUTPUTS, None]}],
                    "description": "what each input's item holds: embedding (dense), sparse_embedding, "
                                   "colbert_embedding; default [\"dense\"]"},
        **sparse._options(model, tei=False)}}


def _taking_outputs(operations: Any, model: ServedModel, tei_body: bool = False) -> dict[str, Any]:
    """The embedding route's operation, its body taking `outputs` and the sparse options and its
    answer holding what they ask for; a TEI body (native route) takes `outputs` as dense alone."""
    document = operations(model)
    post = document["post"]
    content = post["requestBody"]["content"]["application/json"]
    hybrid = {"allOf": [ref("EmbeddingRequest"), _outputs_schema(model)]}
    dense_only = {"properties": {"outputs": {"enum": [None, "dense", ["dense"]]}}}
    content["schema"] = {"anyOf": [hybrid, {"allOf": [ref("TEIEmbedRequest"), {"not": {"required": ["input"]}},
                                                       dense_only]}]} if tei_body else hybrid
    answer = post["responses"]["200"]["content"]["application/json"]
    answer["schema"] = {"anyOf": [ref("HybridEmbeddingList"), ref("TEIEmbeddings")]} if tei_body \
        else ref("HybridEmbeddingList")
    answer.pop("example", None)
    return document


def schemas(model: ServedModel) -> dict[str, Any]:
    if model.task is not Task.HYBRID:
        return {}
    sparse_vector = {"anyOf": [{"type": "object", "required": ["indices", "values"], "properties": {
        "indices": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "values": {"type": "array", "items": {"type": "number"}}}},
        {"type": "object", "additionalProperties": {"type": "number"}}]}
    tokens = {"anyOf": [{"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                        {"type": "string", "contentEncoding": "base64"}]}
    return {"HybridEmbeddingList": {
        "type": "object", "required": ["object", "data", "model", "usage"], "properties": {
            "object": {"const": "list"}, "model": {"const": model.name}, "usage": {"type": "object"},
            "data": {"type": "array", "items": {"type": "object", "required": ["object", "index"], "properties": {
                "object": {"const": "embedding"}, "index": {"type": "integer", "minimum": 0},
                "embedding": ref("Vector"), "sparse_embedding": sparse_vector, "colbert_embedding": tokens}}}}}}


ROUTES = (
    RouteSpec(Route.NATIVE, HYBRID, _parse(Route.NATIVE, allow_token_ids=True, tei_body=True), encode_list,
              partial(_taking_outputs, native._operations, tei_body=True)),
    RouteSpec(Route.OPENAI, HYBRID, _parse(Route.OPENAI, allow_token_ids=True), encode_list,
              partial(_taking_outputs, openai._operations)),
    RouteSpec(Route.TEI_EMBED, HYBRID, _parse(Route.TEI_EMBED, allow_token_ids=False), encode_dense, tei._embed),
    RouteSpec(Route.TEI_EMBED_SPARSE, HYBRID, parse_sparse, encode_sparse, sparse._tei_operations),
)
