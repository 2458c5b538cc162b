"""Table rows into requests that the server accepts: consecutive rows (so answers come back in
input order), at most the server's inputs per request, tokens per request and answer bytes, and
small enough that the requests in flight together stay within one TorchServe batch's work bound
(past it the server answers 503 and the request waits a second to be retried).

Tokens are not counted here (that takes the model's tokenizer); each text is bounded instead. A
token is at least one UTF-8 byte for the tokenizers these models use (WordPiece, BPE, Unigram
with byte fallback), and truncation keeps at most max_input_length, so
min(max_input_length, bytes + 2 special tokens) bounds a text's tokens: the hard limits are held
with it. The work bound is a target, not a limit, so it uses a closer estimate (a token per 3
bytes: English averages 4 to 5). A row the server would refuse on its own (no text, an empty
text, over max_input_chars) is marked here and not sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from embedserve.batch.inputs import Row
from embedserve.batch.server import Limits

# Most rows a request carries: larger requests gain nothing measurable (bench/batch.py) and make
# each retry, and the rows in flight, larger.
DEFAULT_ROWS_PER_REQUEST = 128
SPECIAL_TOKENS = 2
# What an embedding answer spends around each vector and around the list (the handler's own
# figures, embedserve/handler/tasks/embed.py's max_answer_bytes).
ROW_OVERHEAD_BYTES = 64
LIST_OVERHEAD_BYTES = 256


@dataclass(frozen=True)
class Budget:
    rows: int  # inputs per request
    tokens: int  # bound on tokens per request (hard: max_tokens_per_request)
    work_tokens: int  # estimated tokens per request (soft: the batch work bound's share)
    answer_bytes: int  # bound on the answer (hard: max_response_bytes)
    row_answer_bytes: int
    max_input_chars: int
    max_input_length: int

    @classmethod
    def of(cls, limits: Limits, concurrency: int, dimensions: int, model: str,
           rows: int = DEFAULT_ROWS_PER_REQUEST) -> "Budget":
        """For base64 float32 answers of `dimensions` values; the work bound shared by the
        requests in flight, twice over, as TorchServe may batch all of them together."""
        return cls(
            rows=max(1, min(rows, limits.max_inputs)),
            tokens=limits.max_tokens_per_request,
            work_tokens=max(limits.max_input_length, limits.max_batch_work_tokens // (2 * max(1, concurrency))),
            answer_bytes=limits.max_response_bytes - LIST_OVERHEAD_BYTES - len(model),
            row_answer_bytes=4 * -(-4 * dimensions // 3) + ROW_OVERHEAD_BYTES,
            max_input_chars=limits.max_input_chars,
            max_input_length=limits.max_input_length,
        )


@dataclass
class Group:
    """Consecutive rows; `refused` maps a row's position in `rows` to why it is not sent."""

    rows: list[Row] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)

    @property
    def texts(self) -> list[str]:
        return [row.text for i, row in enumerate(self.rows) if i not in self.refused]


def measure(text: str | None, budget: Budget) -> tuple[int, str | None]:
    """The text's UTF-8 bytes, and why the server would refuse it on its own (None: it would not)."""
    if text is None:
        return 0, "no text (the cell is empty)"
    if not text:
        return 0, "an empty text: the service embeds only non-empty texts"
    if len(text) > budget.max_input_chars:
        return 0, f"{len(text)} characters; the server takes at most max_input_chars={budget.max_input_chars}"
    try:
        return len(text.encode("utf-8")), None
    except UnicodeEncodeError:
        return 0, "not valid Unicode (a lone surrogate), which no UTF-8 request can carry"


def groups(rows: Iterator[Row], budget: Budget) -> Iterator[Group]:
    """Consecutive rows in groups of at most `budget.rows` (refused rows count too, so that a run
    of them stays bounded), each group's sent texts within every bound."""
    group, sent, tokens, work = Group(), 0, 0, 0
    for row in rows:
        size, why = measure(row.text, budget)
        bound = min(budget.max_input_length, size + SPECIAL_TOKENS)
        estimate = min(budget.max_input_length, size // 3 + SPECIAL_TOKENS)
        full = len(group.rows) >= budget.rows or (why is None and sent and (
            tokens + bound > budget.tokens or work + estimate > budget.work_tokens
            or (sent + 1) * budget.row_answer_bytes > budget.answer_bytes))
        if full:
            yield group
            group, sent, tokens, work = Group(), 0, 0, 0
        if why is None:
            sent, tokens, work = sent + 1, tokens + bound, work + estimate
        else:
            group.refused[len(group.rows)] = why
        group.rows.append(row)
    if group.rows:
        yield group
