"""The hybrid task (bge-m3): any of a dense vector, a sparse vector and ColBERT token vectors per
input, all three from the one forward pass the batch makes anyway (model/m3.py).

A request names what it wants in `outputs` (default ["dense"]: the answer of any embedding
model); the dense vector takes the embed task's options (dimensions, normalize, output dtype,
encoding), the sparse one the sparse task's (threshold, max_active_dims, sparse_format), the
ColBERT vectors the output dtype and encoding (they are unit vectors, as FlagEmbedding gives them;
`dimensions` cuts the dense vector only). Preparation is the embed task's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedserve.handler.api.codec import json_type, short
from embedserve.handler.api.errors import RequestError, malformed, too_large
from embedserve.handler.api.quantize import quantize
from embedserve.handler.api.route import Route
from embedserve.handler.model.description import Task
from embedserve.handler.tasks.base import Job, Outcome, each_result
from embedserve.handler.tasks.embed import EmbeddingRequest, Embeddings, EmbedTask, Input, Options, max_answer_bytes
from embedserve.handler.tasks.sparse import SparseOptions, SparseVectors, sparse_answer_bytes, sparse_vectors

OUTPUTS = ("dense", "sparse", "colbert")


@dataclass(frozen=True)
class HybridRequest:
    route: Route
    inputs: tuple[Input, ...] = ()
    options: Options = field(default_factory=Options)  # the dense vector's, and the preparation's
    outputs: tuple[str, ...] = ("dense",)
    sparse: SparseOptions = field(default_factory=SparseOptions)
    field: str = "input"

    def param(self, index: int) -> str:
        return f"{self.field}[{index}]"


@dataclass(frozen=True)
class HybridResult:
    """What the request asked for, each None where it did not."""
    dense: Embeddings | None
    sparse: SparseVectors | None
    colbert: list[np.ndarray] | None  # per input, (tokens - 1, dimension), in the requested dtype
    tokens: int


def parse_outputs(value: Any) -> tuple[str, ...]:
    """`outputs`: a list of distinct names of OUTPUTS (a lone name is a list of one); missing or
    null, ["dense"]."""
    if value is None:
        return ("dense",)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names) \
            or len(set(names)) != len(names) or set(names) - set(OUTPUTS):
        raise malformed(f"'outputs' must be a list of distinct names among {', '.join(OUTPUTS)}, got "
                        f"{json_type(value)} {short(value)}", param="outputs")
    return tuple(names)


def hybrid_request(request: EmbeddingRequest, outputs: tuple[str, ...], sparse: SparseOptions) -> HybridRequest:
    return HybridRequest(request.route, request.inputs, request.options, outputs, sparse, field=request.field)


class HybridTask(EmbedTask):
    task = Task.HYBRID

    def _check_options(self, request: HybridRequest, normalize: bool, answer: bool = True) -> None:
        """The embedding options' values whatever is asked (as the OpenAPI document says), the
        dense answer's size bound where the dense vector is asked for."""
        super()._check_options(request, normalize, answer="dense" in request.outputs)

    def results(self, jobs: dict[int, Job], outcomes: dict[int, Outcome]) -> dict[int, HybridResult | RequestError]:
        dense_jobs = {index: job for index, job in jobs.items() if "dense" in job.request.outputs}
        dense = super().results(dense_jobs, {index: (outcomes[index][0].dense, outcomes[index][1])
                                             for index in dense_jobs})
        failed = {index: error for index, error in dense.items() if isinstance(error, RequestError)}
        shaped = each_result({index: job for index, job in jobs.items() if index not in failed},
                             lambda index, job: self._result(job, outcomes[index][0], dense.get(index)), "hybrid")
        return {**failed, **shaped}

    def _result(self, job: Job, vectors: Any, dense: Embeddings | None) -> HybridResult:
        request: HybridRequest = job.request
        options, max_bytes = request.options, self.settings.max_response_bytes
        sparse = sparse_vectors(request, request.sparse, vectors.sparse, job.tokens, self.tokenizer.token_name,
                                self.checks.model_name, max_bytes) if "sparse" in request.outputs else None
        colbert = [quantize(rows, options.output_dtype) for rows in vectors.colbert] \
            if "colbert" in request.outputs else None
        answer = 0
        if dense is not None:
            answer += max_answer_bytes(len(request.inputs), options.dimensions or self.checks.dimension,
                                       options.output_dtype, options.encoding_format, route=request.route)
        if sparse is not None:
            answer += sparse_answer_bytes(sum(len(ids) for ids in sparse.ids), len(sparse.ids))
        if colbert is not None:
            width = vectors.colbert[0].shape[1] if vectors.colbert else 0
            answer += max_answer_bytes(sum(len(rows) for rows in colbert), width, options.output_dtype,
                                       options.encoding_format, route=request.route)
        if answer > max_bytes:
            raise too_large(f"'{request.field}' has {len(request.inputs)} inputs, whose {', '.join(request.outputs)} "
                            f"outputs take up to {answer} bytes; the server sends at most max_response_bytes="
                            f"{max_bytes} per answer: send fewer or shorter inputs per request, fewer 'outputs', "
                            "\"encoding_format\": \"base64\" or a smaller 'output_dtype'", param=request.field)
        return HybridResult(dense, sparse, colbert, job.tokens)
