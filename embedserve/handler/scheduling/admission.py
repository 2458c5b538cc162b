"""Admission under the work budget: which of a batch's requests go to the model now.

The server kills a worker whose batch runs past the response timeout and fails every request
of it, so each batch holds at most the work this worker embeds in a share of that timeout, at
the speed it measured at warm-up. Plain arithmetic on token counts, with no errors and no model:
the caller decides how a refused request is answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# The share of the response timeout one batch's work may take at the speed measured at warm-up.
# Real traffic runs slower than the measured full passes: padding (about 10%), workers sharing the
# memory bus (about 15%), passes longer than the 64-token calibration ones (attention grows with
# length), and cores shared with the frontend, the other workers and, on a small machine, the
# clients. Half the timeout was not enough: in the default build's 10,000-request fuzz run (2
# shared cores, OpenVINO bfloat16 at about 19,000 tokens/s measured, so 1.15 M tokens of work), a
# batch holding a 4,096-text request of 256-token texts (1,048,576 tokens) ran past the 120 s
# timeout, over twice its measured time, and the worker was killed with its batch. A quarter
# keeps such a batch out (413 for the request, a 503 retry for a batch it would overfill).
WORK_SHARE = 0.25


@dataclass(frozen=True)
class WorkBudget:
    tokens: int  # the most tokens of work one batch may hold
    tokens_per_second: float  # the speed it was computed from
    response_timeout_s: float


def work_budget(tokens_per_second: float | None, response_timeout_s: float) -> WorkBudget | None:
    """The budget at `tokens_per_second`; None without a measured speed (warm-up off), where only
    max_tokens_per_request bounds the work."""
    if not tokens_per_second:
        return None
    return WorkBudget(int(tokens_per_second * response_timeout_s * WORK_SHARE), tokens_per_second,
                      response_timeout_s)


def max_request_tokens(limit: int, budget: WorkBudget | None) -> int:
    """The most tokens one request may hold: the `max_tokens_per_request` limit, or less where a
    batch may hold less work."""
    return min(limit, (budget.tokens if budget else 0) or limit)


@dataclass
class Admission:
    admitted: list[int] = field(default_factory=list)  # in arrival order
    refused: dict[int, int] = field(default_factory=dict)  # index -> tokens the batch held when it came


def admit(tokens: Mapping[int, int], budget: WorkBudget | None) -> Admission:
    """The requests (index -> tokens, in arrival order) the budget holds, first come first
    served; a request that would push the batch over it is refused, and later smaller ones may
    still fit."""
    if budget is None:
        return Admission(admitted=list(tokens))
    admission, work = Admission(), 0
    for index, count in tokens.items():
        if work + count > budget.tokens:
            admission.refused[index] = work
            continue
        admission.admitted.append(index)
        work += count
    return admission
