"""The text kind: texts (or token ids) from a request's body to the model's token ids.

Reading: an item is a non-empty string, or, where the route takes them (OpenAI's token-array
input), a non-empty list of non-negative token ids. Limits: characters per text before any
tokenizing (max_input_chars), then tokens per input against the model's length, cut or refused
(truncate). Preparation: the texts of all requests of a batch are tokenized in one call, the
tokenizer's own batching being far cheaper than a call per request; a text that breaks the
tokenizer sends each request's texts through alone, so that the failure is its owner's only.
Cost: a text's model input is its token ids; the planner prices a pass by its padded tokens.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Sequence, Union

from embedserve.handler.api.codec import as_int, json_type, short
from embedserve.handler.api.errors import empty, malformed, too_large, unprocessable
from embedserve.handler.model.tokenization import TextTokenizer
from embedserve.handler.settings import Settings

# One input: a text, or pre-tokenized ids (OpenAI's token-array input).
Input = Union[str, tuple[int, ...]]


# --- reading the items -----------------------------------------------------------------------------

def read_text(text: str, param: str) -> str:
    """A string item (its type already checked): refused where empty."""
    if not text:
        raise empty(f"'{param}' must not be an empty string", param=param)
    return text


def read_inputs(value: Any, name: str, allow_token_ids: bool) -> tuple[Input, ...]:
    """A text or a non-empty list of texts; with `allow_token_ids`, token-id lists too (one list
    of ids alone is one input)."""
    kinds = "a string or a list of strings" + (", or token ids" if allow_token_ids else "")
    if isinstance(value, str):
        return (read_text(value, name),)
    if not isinstance(value, list):
        raise malformed(f"'{name}' must be {kinds}, got {json_type(value)}", param=name)
    if not value:
        raise empty(f"'{name}' must not be an empty list", param=name)
    if allow_token_ids and as_int(value[0]) is not None:  # one pre-tokenized input: [101, 2023, ...]
        return (_read_ids(value, name),)
    return tuple(read_item(item, f"{name}[{i}]", allow_token_ids) for i, item in enumerate(value))


def read_item(item: Any, param: str, allow_token_ids: bool) -> Input:
    """One item of a list of inputs: a text, or token ids where allowed."""
    if isinstance(item, str):
        return read_text(item, param)
    if allow_token_ids and isinstance(item, list):
        return _read_ids(item, param)
    expected = "a string" + (" or a list of token ids" if allow_token_ids else "")
    raise malformed(f"'{param}' must be {expected}, got {json_type(item)}", param=param)


def _read_ids(ids: list, param: str) -> tuple[int, ...]:
    if not ids:
        raise empty(f"'{param}' must not be an empty list of token ids", param=param)
    checked = []
    for j, token in enumerate(ids):
        number = as_int(token)
        if number is None or number < 0:
            raise malformed(f"'{param}[{j}]' must be a non-negative integer token id, got {short(token)}",
                            param=f"{param}[{j}]")
        checked.append(number)
    return tuple(checked)


def read_texts(value: Any, name: str, objects: bool = False) -> list[str]:
    """A non-empty list of texts; with `objects`, {"text": ...} items too (Cohere, Jina)."""
    if not isinstance(value, list):
        raise malformed(f"'{name}' must be a list of strings, got {json_type(value)}", param=name)
    if not value:
        raise empty(f"'{name}' must not be an empty list", param=name)
    texts = []
    for i, item in enumerate(value):
        param = f"{name}[{i}]"
        if objects and isinstance(item, dict):
            item, param = item.get("text"), f"{param}.text"
        if not isinstance(item, str):
            kind = "a string or an object with a 'text' string" if objects else "a string"
            raise malformed(f"'{param}' must be {kind}, got {json_type(item)}", param=param)
        texts.append(read_text(item, param))
    return texts


# --- limits and preparation ------------------------------------------------------------------------

class TextLimits:
    """The text kind's limits, and its model ids with the server's defaults."""

    def __init__(self, tokenizer: TextTokenizer, settings: Settings, max_length: int):
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_length = max_length  # tokens per input

    def chars(self, text: str, param: str) -> None:
        if len(text) > self.settings.max_input_chars:
            raise too_large(f"'{param}' has {len(text)} characters; the limit is "
                            f"max_input_chars={self.settings.max_input_chars}", param=param)

    def length(self, param: str, full_length: int, truncate: bool, what: str = "") -> None:
        """An input of `full_length` tokens: refused over the model's length with truncation off."""
        if not truncate and full_length > self.max_length:
            raise too_large(f"'{param}' has {full_length} tokens{what}; the limit is {self.max_length} "
                            "and truncation is off (send \"truncate\": true to cut it)", param=param)

    def vocabulary(self, ids: Sequence[int], param: str) -> None:
        """Token ids sent as an input: each within the tokenizer's vocabulary."""
        for j, token in enumerate(ids):
            if token >= self.tokenizer.vocab_size:
                raise unprocessable(f"'{param}[{j}]' is token id {token}, outside the vocabulary of "
                                    f"{self.tokenizer.vocab_size}", param=f"{param}[{j}]")

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Model input ids with the server's defaults (right truncation at max_length, no prompt)."""
        return [self.tokenizer.assemble(body, self.max_length, "right").ids for body in self.tokenizer.body_ids(texts)]


class BatchTokenizing:
    """The texts of several requests (groups) tokenized in one call, without special tokens; where
    a text breaks the tokenizer, each group's texts alone when asked for, so that the failure
    raises in its own group only."""

    def __init__(self, tokenizer: TextTokenizer, groups: Sequence[Sequence[str]]):
        self._tokenizer = tokenizer
        self._groups = groups
        self._starts = [0, *accumulate(map(len, groups))]
        texts = [text for group in groups for text in group]
        try:
            self._all: list[list[int]] | None = tokenizer.body_ids(texts) if texts else []
        except Exception:  # a text that breaks the tokenizer: each group alone finds its owner
            self._all = None

    def body_ids(self, group: int) -> list[list[int]]:
        """Group `group`'s token ids, in order; raises what its own texts raise the tokenizer."""
        if self._all is None:
            return self._tokenizer.body_ids(list(self._groups[group]))
        return self._all[self._starts[group]:self._starts[group + 1]]
