"""The routes that describe the server, answered from what was assembled: info (TEI's /info),
openapi.json, the API page (docs) and TEI's /tokenize, which every model answers whatever its task."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from embedserve.handler.api.codec import dumps
from embedserve.handler.api.docs_page import assets_present, docs_answer
from embedserve.handler.api.errors import too_large
from embedserve.handler.api.exchange import JSON
from embedserve.handler.api.quantize import OUTPUT_DTYPES
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import ModelDescription, Task
from embedserve.handler.routes.schema import DESCRIBE_ERRORS, ServedModel, error_responses, operation, ref
from embedserve.handler.tasks.embed import ENCODING_FORMATS, MODALITIES, EmbeddingRequest, EmbedTask

def openapi_operations(model: ServedModel) -> dict[str, Any]:
    return {"get": operation("openapi", "This document, with the model's real values; any method, any body", None,
                             {"schema": ref("OpenAPIDocument")},
                             error_responses(DESCRIBE_ERRORS, Route.OPENAPI, model.server))}


def docs_operations(model: ServedModel) -> dict[str, Any]:
    page = operation("docs", "This document as a browsable page (Swagger UI; its files under docs/); any method, "
                             "any body", None, {"schema": {"type": "string"}},
                     error_responses(DESCRIBE_ERRORS, Route.DOCS, model.server))
    page["responses"]["200"]["content"] = {"text/html": {"schema": {"type": "string"}}}
    page["responses"]["404"] = {"description": "an archive built without the page's files, or an unknown file name",
                                "content": {"application/json": {"schema": ref("OpenAIError")}}}
    return {"get": page}


class Description:
    """`info` and `openapi` build those bodies from the service; the document is built once, on
    first use, when the worker's limits are final."""

    def __init__(self, info: Callable[[Any], dict[str, Any]], openapi: Callable[[Any], dict[str, Any]],
                 openapi_url: str):
        self.info = info
        self.openapi = openapi
        self.openapi_url = openapi_url
        self._openapi_body: bytes | None = None

    def answer(self, service: Any, route: Route, request: EmbeddingRequest | None, rest: str
               ) -> tuple[int, bytes, str]:
        if route is Route.TEI_INFO:
            return 200, dumps(self.info(service)), JSON
        if route is Route.OPENAPI:
            if self._openapi_body is None:
                self._openapi_body = dumps(self.openapi(service))
            return 200, self._openapi_body, JSON
        if route is Route.DOCS:
            return docs_answer(rest, self.openapi_url)
        return 200, tokens_body(service.text, request, service.settings.max_response_bytes), JSON


def tokens_body(text: EmbedTask, request: EmbeddingRequest, max_response_bytes: int) -> bytes:
    """/tokenize's answer, refused when larger than the server passes on (it would drop the
    worker): its size is known only once built, about 60 bytes a token."""
    body = dumps(text.tokens(request))
    if len(body) > max_response_bytes:
        raise too_large(f"the answer lists the tokens of '{request.field}' in {len(body)} bytes; the server "
                        f"sends at most max_response_bytes={max_response_bytes} per answer: send fewer "
                        "or shorter inputs", param=request.field)
    return body


def info_body(service: Any, model: ModelDescription) -> dict[str, Any]:
    """The /info body (TEI's keys, and what this server adds): the model, how it runs, the limits."""
    settings, encoder, text, cache = service.settings, service.encoder, service.text, service.cache
    placement = encoder.placement
    return {
        "model_id": settings.model_id or service.model_name,
        "revision": settings.revision or None,
        "workers_sizing": settings.workers_sizing or None,
        "served_model_name": service.model_name,
        "model_type": _model_type(model),
        "task": service.task,
        "routes": [route.value for route in service.routes],
        "model_dtype": "int8" if placement.int8 else str(placement.dtype).removeprefix("torch."),
        "device": str(placement.device),
        **encoder.describe(),  # engine; "layout": padded or packed; the attention kernel; CUDA graphs
        "selected_by": encoder.reasons,
        "embedding_dimension": encoder.dimension,
        "max_input_length": text.max_length,
        "architecture": model.model_type,
        "model_class": _model_class(model),  # transformers' native class (NomicBertModel for a converted nomic-bert)
        "pooling": encoder.pooling.name if model.scoring is None or not model.scoring.own_head else None,
        "modules": model.modules,
        "normalize": settings.normalize,
        "auto_truncate": settings.truncate,
        "prompts": text.prompts,
        "default_prompt": text.default_prompt,
        "max_client_batch_size": settings.max_inputs_per_request,
        "max_input_chars": settings.max_input_chars,
        "max_tokens_per_request": service.max_request_tokens,
        "max_batch_work_tokens": service.batch_work_tokens,
        "tokens_per_second": round(service.tokens_per_second) if service.tokens_per_second else None,
        "max_response_bytes": settings.max_response_bytes,
        "max_batch_tokens": placement.max_batch_tokens,
        "max_batch_size": settings.max_batch_size,
        "pass_overhead_tokens": encoder.pass_overhead_tokens,
        "cache": {"memory_entries": settings.cache_entries if cache and cache.memory is not None else 0,
                  "redis": bool(cache and cache.redis)},
        "output_dtypes": list(OUTPUT_DTYPES),
        "encoding_formats": list(ENCODING_FORMATS),
        # What the inputs may be ("modality"), and an image model's image limits.
        "modalities": list(MODALITIES) if text.images is not None else [MODALITIES[0]],
        **({"image_limits": asdict(text.images.limits)} if text.images is not None else {}),
        "api_page": assets_present(),
    }


def _model_class(model: ModelDescription) -> str | None:
    """The transformers class the model is loaded as (or, on ONNX, was exported from)."""
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if model.scoring and model.scoring.own_head \
        else modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES if model.sparse else modeling_auto.MODEL_MAPPING_NAMES
    return names.get(model.model_type)


def _model_type(model: ModelDescription) -> Any:
    """TEI's model_type: "embedding" (sparse and hybrid ones too, as TEI says of SPLADE), or
    {"reranker"|"classifier": {"id2label": ...}}."""
    if model.task in (Task.EMBED, Task.SPARSE, Task.HYBRID, Task.MULTI_VECTOR):
        return "embedding"
    kind = "reranker" if model.task is Task.RERANK else "classifier"
    return {kind: {"id2label": {str(i): label for i, label in enumerate(model.scoring.labels)}}}
