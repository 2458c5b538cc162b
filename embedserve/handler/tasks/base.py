"""What every task slice shares: the prepared request (a Job), the checks every request meets
before the model, and the contract a slice keeps with the service.

A task is what the model serves (model/files.py decides it once from the folder: embed, rerank,
classify). Its slice (tasks/embed.py, tasks/score.py) owns its request type, its preparation into
one ModelInput per input, its answer's size bound, and its result; the route families
(embedserve/handler/routes/) read its requests off the wire and write its results back.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Any, Callable, Protocol, Sequence, Union

import torch

from embedserve.handler.api.errors import RequestError, internal_error, out_of_memory, too_large
from embedserve.handler.inputs.text import TextLimits
from embedserve.handler.model.description import Task
from embedserve.handler.model.inputs import ModelInput, distinct_tokens
from embedserve.handler.model.tokenization import TextTokenizer
from embedserve.handler.scheduling.admission import WorkBudget, max_request_tokens
from embedserve.handler.settings import Settings
from embedserve.handler.worker.failures import log_failure


class TaskRequest(Protocol):
    """What the service and the error paths read of any task's request."""
    inputs: Sequence[Any]
    field: str  # the JSON field its inputs came from, to name it in errors

    def param(self, index: int) -> str:
        """Input `index`'s place in the body, for errors."""


@dataclass(frozen=True)
class Job:
    """A valid request of any task, tokenized: one model input per input of the request."""
    request: TaskRequest
    inputs: list[ModelInput]
    normalize: bool = False  # an embedding answer's own normalization
    # What the task computed without the model, and its tokens (an inference-free query's weights):
    # such a job has no model inputs.
    computed: tuple[Any, int] | None = None
    # Inputs cut into windows (tasks/chunking.py): each input's count of model inputs, in order,
    # and each model input's weight in its input's vector; None: one model input per input.
    windows: tuple[int, ...] | None = None
    weights: tuple[int, ...] | None = None
    # Late chunking (tasks/chunking.py): each input's spans, a model input each (`windows` counts them).
    spans: tuple[tuple[Any, ...], ...] | None = None

    def owner(self, item: int) -> int:
        """The request's input that model input `item` is (a window of)."""
        return item if self.windows is None else bisect_right(list(accumulate(self.windows)), item)

    @cached_property  # read by admission and again by the answer
    def tokens(self) -> int:
        if self.computed:
            return self.computed[1]
        return distinct_tokens(self.inputs)


# One request's model outputs (vectors or logits) and its inputs that did not fit in memory even
# alone, or its error.
Outcome = Union[tuple[torch.Tensor, frozenset[int]], RequestError]


class TaskSlice(Protocol):
    task: Task

    def prepare(self, requests: dict[int, Any], budget: WorkBudget | None) -> dict[int, Job | RequestError]:
        """Each request checked and tokenized on its own: its Job, or its error."""

    def results(self, jobs: dict[int, Job], outcomes: dict[int, Outcome]) -> dict[int, Any]:
        """Each request's result (what its route encodes), or its error; `outcomes` has no error
        and no unfit input left."""


class RequestChecks:
    """The limits every request of every task meets, the model facts its checks need, and the
    limits of the input kinds the model reads (`text`, inputs/text.py)."""

    def __init__(self, tokenizer: TextTokenizer, settings: Settings, *, model_name: str, dimension: int,
                 max_length: int):
        self.tokenizer = tokenizer
        self.settings = settings
        self.model_name = model_name
        self.dimension = dimension  # the served vector's width; a scoring model's label count
        self.max_length = max_length  # tokens per input
        self.text = TextLimits(tokenizer, settings, max_length)

    def count(self, request: TaskRequest) -> None:
        if len(request.inputs) > self.settings.max_inputs_per_request:
            raise too_large(f"'{request.field}' has {len(request.inputs)} inputs; the limit is "
                            f"max_inputs_per_request={self.settings.max_inputs_per_request}", param=request.field)

    def answer_size(self, request: TaskRequest, answer: int, remedy: str) -> None:
        """A request whose answer could exceed what the server sends back is refused before any work."""
        if answer > self.settings.max_response_bytes:
            raise too_large(f"'{request.field}' has {len(request.inputs)} inputs, whose answer could take {answer} "
                            f"bytes; the server sends at most max_response_bytes={self.settings.max_response_bytes} "
                            f"per answer (the archive's, or the server's max_response_size where lower): {remedy}",
                            param=request.field)

    def tokens(self, total: int, field: str, budget: WorkBudget | None) -> None:
        if total > self.settings.max_tokens_per_request:
            raise too_large(f"the request has {total} tokens; the limit is max_tokens_per_request="
                            f"{self.settings.max_tokens_per_request}", param=field)
        limit = max_request_tokens(self.settings.max_tokens_per_request, budget)
        if total > limit:  # only under a work budget
            raise too_large(f"the request has {total} tokens; this worker embeds about "
                            f"{budget.tokens_per_second:.0f} tokens/s, so a request may hold at most "
                            f"{limit} tokens to finish well within the server's "
                            f"{budget.response_timeout_s:.0f} s response timeout; send fewer or shorter inputs per "
                            "request", param=field)


def each_request(requests: dict[int, Any], prepare: Callable[[Any], Job]) -> dict[int, Job | RequestError]:
    """`prepare` of each request on its own: its Job, or its error (a bug met by one request is
    its own 500, logged, and fails no other)."""
    outcomes: dict[int, Job | RequestError] = {}
    for index, request in requests.items():
        try:
            outcomes[index] = prepare(request)
        except RequestError as err:
            outcomes[index] = err
        except Exception as err:
            log_failure(f"preparing request {index} of the batch", err)
            outcomes[index] = internal_error()
    return outcomes


def each_result(jobs: dict[int, Job], shape: Callable[[int, Job], Any], what: str) -> dict[int, Any]:
    """`shape` of each job's result on its own: its result, or its error (a bug met by one answer
    is its own 500, logged, and fails no other)."""
    results: dict[int, Any] = {}
    for index, job in jobs.items():
        try:
            results[index] = shape(index, job)
        except RequestError as err:
            results[index] = err
        except Exception as err:
            log_failure(f"shaping the {what} answer of request {index} of the batch", err)
            results[index] = internal_error("the server failed to encode this answer; the failure is logged")
    return results


def does_not_fit(job: Job, item: int) -> RequestError:
    param = job.request.param(job.owner(item))
    what = "a span of " if job.spans is not None else "a window of " if job.windows is not None else ""
    return out_of_memory(f"{what}'{param}' ({len(job.inputs[item])} tokens) does not fit in memory even alone; send "
                         "it shorter or lower max_length", param=param)
