"""(query, document) pairs as a causal language model reranker reads them: rendered through the
model's own chat template, as sentence-transformers 6's CrossEncoder renders them.

For such a model sentence-transformers turns a pair into two chat messages, roles "query" and
"document" (an instruction goes first, as a "system" message), renders them with the tokenizer's
`apply_chat_template` and tokenizes the result without adding special tokens, truncating at the
token limit. Truncation cuts the rendered string blind to its structure, so it would cut off the
template's closing tokens (Qwen3-Reranker's "<|im_end|>\\n<|im_start|>assistant\\n<think>..."),
after which the model would score from the wrong position: a row that reaches the limit gets
those closing tokens written back over its last tokens. The closing tokens are found as
sentence-transformers finds them: the template is rendered twice with different fillers for the
pair and the longest common token tail is the template's own.

The same tokenizer calls, in the same order, give the same ids: the build compares the scores
with CrossEncoder.predict's and refuses a model whose rendering differs.
"""

from __future__ import annotations

from typing import Any, Sequence

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from embedserve.handler.model.description import ChatFormat, ModelFilesError
from embedserve.handler.model.tokenization import Tokenized

# The fillers whose two renders differ only in the pair's content (sentence-transformers' own).
_FILLERS = ("0", "1 2 3 4")


class ChatTemplateError(ValueError):
    """The model's chat template refused a conversation (its own raise_exception, or an error of
    its rendering): the request's fault, not the server's."""


class ChatPairTokenizer:
    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, chat: ChatFormat):
        """`hf_tokenizer`: the model's Hugging Face tokenizer (shared with TextTokenizer, loaded once)."""
        self.hf = hf_tokenizer
        if not getattr(self.hf, "chat_template", None):
            raise ModelFilesError(f"{hf_tokenizer.name_or_path} has no chat template: a causal reranker's pairs are "
                                  "rendered by it")
        self.chat = chat
        self.template_kwargs: dict[str, Any] = dict(chat.template_kwargs)
        self._suffixes: dict[str, list[int]] = {}  # by instruction: the template's closing tokens

    def messages(self, query: str, document: str, instruction: str = "") -> list[dict[str, Any]]:
        """The conversation sentence-transformers renders for a pair. An empty instruction is
        none, as there: the template's own default instruction applies."""
        roles = ([("system", instruction)] if instruction else []) + [("query", query), ("document", document)]
        if self.chat.message_format == "flat":
            return [{"role": role, "content": text} for role, text in roles]
        return [{"role": role, "content": [{"type": "text", "text": text}]} for role, text in roles]

    def pairs(self, pairs: Sequence[tuple[str, str]], max_length: int, direction: str,
              instruction: str = "") -> list[Tokenized]:
        """Each pair's ids: rendered, cut to max_length on `direction`, the template's closing
        tokens written back over a row that reaches max_length; with the full length, for "too
        long" errors."""
        full = self._render([self.messages(query, document, instruction) for query, document in pairs])
        result = []
        for ids in full:
            kept = list(ids[:max_length] if direction == "right" else ids[max(0, len(ids) - max_length):])
            if self.chat.restore_suffix and len(kept) >= max_length:
                suffix = self.suffix(instruction)
                keep = min(len(suffix), len(kept))
                if keep:
                    kept[-keep:] = suffix[-keep:]
            result.append(Tokenized(kept, len(ids)))
        return result

    def _render(self, conversations: list[list[dict[str, Any]]]) -> list[list[int]]:
        """Token ids of each conversation's render, untruncated."""
        if not conversations:
            return []
        try:
            # Renders are measured and cut here, never by the tokenizer: no "longer than the maximum" warning.
            out = self.hf.apply_chat_template(conversations, tokenize=True, return_dict=True, padding=False,
                                              truncation=False, tokenizer_kwargs={"verbose": False},
                                              **self.template_kwargs)
        except TemplateError as err:
            raise ChatTemplateError(str(err)) from None
        return [list(ids) for ids in out["input_ids"]]

    def suffix(self, instruction: str) -> list[int]:
        """The template's closing tokens after a pair: the longest common tail of two renders
        with different fillers; none where the renders never differ."""
        if instruction not in self._suffixes:
            first, second = self._render([self.messages(filler, filler, instruction) for filler in _FILLERS])
            count = 0
            for left, right in zip(reversed(first), reversed(second)):
                if left != right:
                    break
                count += 1
            suffix = first[len(first) - count:] if 0 < count < min(len(first), len(second)) else []
            if len(self._suffixes) > 256:  # instructions come from requests: keep the cache bounded
                self._suffixes.pop(next(iter(self._suffixes)))
            self._suffixes[instruction] = suffix
        return self._suffixes[instruction]
