"""The embedding engine: a batch of raw requests in, one response per request out.

Server-agnostic: TorchServe's adapter (ts_handler.py) only moves bytes and statuses in and out.
Every text of every valid request is flattened into one item list, embedded together, and
split back by span; a request that fails validation gets its own error response and takes no
part in the forward pass, so it never fails its batch-mates.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from handler.batching import flatten
from handler.codec import EmbeddingRequest, encode_embeddings, encode_error, parse_request
from handler.encoder import Encoder
from handler.errors import RequestError, invalid
from handler.pooling import l2_normalize

log = logging.getLogger(__name__)

WARMUP_TEXT = "Warm-up: the worker embeds this once before it reports ready."


@dataclass(frozen=True)
class RawRequest:
    body: Any
    content_type: str | None = None
    url_path: str | None = None


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class EmbeddingEngine:
    def __init__(self, encoder: Encoder, model_name: str):
        self.encoder = encoder
        self.model_name = model_name

    def warmup(self) -> None:
        vectors = self.encoder.embed(self.encoder.tokenize([WARMUP_TEXT]))
        if not torch.isfinite(vectors).all():
            raise RuntimeError("warm-up embedding is not finite; the model weights are broken")

    def handle(self, raw_requests: Sequence[RawRequest]) -> list[Response]:
        started = time.perf_counter()
        outcomes: list[EmbeddingRequest | RequestError] = [self._parse(raw) for raw in raw_requests]
        valid = [i for i, o in enumerate(outcomes) if isinstance(o, EmbeddingRequest)]

        texts, spans = flatten([outcomes[i].texts for i in valid])
        token_ids = self.encoder.tokenize(texts) if texts else []
        vectors = self.encoder.embed(token_ids) if texts else None

        responses: list[Response | None] = [None] * len(raw_requests)
        headers = {"x-batch-size": str(len(raw_requests))}
        for i, span in zip(valid, spans):
            request = outcomes[i]
            body = encode_embeddings(
                self._finish(vectors[span], request).numpy(),
                model_name=self.model_name,
                prompt_tokens=sum(len(ids) for ids in token_ids[span]),
                encoding_format=request.encoding_format,
            )
            responses[i] = Response(200, body, headers)
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, RequestError):
                responses[i] = Response(outcome.status, encode_error(outcome), headers)

        elapsed_ms = (time.perf_counter() - started) * 1000
        # Counts only: request text never reaches the logs.
        log.debug("batch: %d requests, %d texts, %.1f ms", len(raw_requests), len(texts), elapsed_ms)
        return responses

    def _parse(self, raw: RawRequest) -> EmbeddingRequest | RequestError:
        try:
            request = parse_request(raw.body, raw.content_type, raw.url_path)
        except RequestError as err:
            return err
        if request.dimensions is not None and request.dimensions > self.encoder.dimension:
            return invalid(
                f"'dimensions' must be at most the model's dimension {self.encoder.dimension}, "
                f"got {request.dimensions}",
                param="dimensions",
            )
        return request

    def _finish(self, vectors: torch.Tensor, request: EmbeddingRequest) -> torch.Tensor:
        """Matryoshka truncation first, then normalization, so truncated vectors are unit length."""
        if request.dimensions is not None:
            vectors = vectors[:, : request.dimensions]
        if self.encoder.settings.normalize:
            vectors = l2_normalize(vectors)
        return vectors
