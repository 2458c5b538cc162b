"""Tokenization with the model's fast tokenizer: texts or token ids to model input ids.

Texts are tokenized without special tokens, truncated on the requested side to leave room for
them, and wrapped in the model's special tokens ([CLS] ... [SEP], <s> ... </s>, ... </s>, or the
end-of-text token a decoder's tokenizer appends). This gives exactly what
`tokenizer(text, truncation=True, max_length=...)` gives, for either truncation side per request,
plus each input's full length for "too long" errors, without mutating any shared tokenizer state.

A prompt is tokenized together with its text, as sentence-transformers does (`prompt + text`, one
string: the tokens at the seam are the model's own), and truncation never cuts into it: on either
side it cuts the text only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple, Sequence

from tokenizers import Tokenizer, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from embedserve.handler.model.description import ModelFilesError


def set_parallelism(threads: int) -> None:
    """Whether the Rust tokenizer splits a batch over its own thread pool, and of how many threads
    (0: none; process-wide, before the first batch; TOKENIZERS_PARALLELISM and RAYON_NUM_THREADS in
    the environment win). A CPU worker owns one or two cores that the model needs: there, a batch
    of short texts costs more in hand-offs between the pool's threads than the pool saves (59
    against 34 us a text, batches of 16 one-text requests). A GPU worker's host cores idle while it
    computes, but it shares them with the other workers on the host: left alone, the pool would
    start a thread for every core in each of them (128 threads for 8 workers on 16 cores)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if threads else "false")
    if threads:
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))


class Tokenized(NamedTuple):  # one an input: a named tuple costs a fraction of a frozen dataclass to make
    ids: list[int]  # model input, special tokens included, truncated
    full_length: int  # the length it would have without truncation
    second: int = 0  # where a pair's second text starts, as token type 1 (0: one text, or no types)


class TextTokenizer:
    def __init__(self, model_dir: str | Path, lowercase: bool = False,
                 hf_tokenizer: PreTrainedTokenizerBase | None = None):
        """`hf_tokenizer`: the folder's Hugging Face tokenizer where the caller has loaded it already."""
        if hf_tokenizer is None:
            hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ModelFilesError(f"{model_dir} has no fast tokenizer (tokenizer.json)")
        # A private copy without the file's own truncation and padding: we do both ourselves.
        self.backend = Tokenizer.from_str(backend.to_str())
        self.backend.no_truncation()
        self.backend.no_padding()
        if lowercase:  # sentence-transformers' do_lower_case: a Lowercase normalizer in front
            current = self.backend.normalizer
            self.backend.normalizer = normalizers.Sequence(
                [normalizers.Lowercase(), *([current] if current is not None else [])])
        self.ascii_backend = self._ascii_backend(lowercase)
        self.special_ids = frozenset(hf_tokenizer.all_special_ids)
        # The named special tokens' ids, by role ("cls", "eos", "pad", "unk", ...).
        self.role_ids = {role.removesuffix("_token"): hf_tokenizer.convert_tokens_to_ids(token)
                         for role, token in hf_tokenizer.special_tokens_map.items() if isinstance(token, str)}
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.model_max_length = hf_tokenizer.model_max_length
        pad_id = hf_tokenizer.pad_token_id
        self.pad_id = pad_id if pad_id is not None else 0
        self.prefix, self.suffix = self._special_tokens_around()
        # Whether the model is given token types: only where the tokenizer hands them on.
        self.token_types = "token_type_ids" in (hf_tokenizer.model_input_names or ())
        self.gives_attention_mask = "attention_mask" in (hf_tokenizer.model_input_names or ())
        # Where padding goes when a model is fed a fixed length (SigLIP's towers, model/towers.py):
        # SigLIP 2's Gemma tokenizers pad on the left, and its text tower pools the last position.
        self.pads_left = getattr(hf_tokenizer, "padding_side", "right") == "left"
        self._truncating_copies: dict[tuple[int, str], Tokenizer] = {}

    def token(self, role: str) -> str:
        """The special token of `role` ("bos", "pad", ...) as text."""
        if role not in self.role_ids:
            raise ModelFilesError(f"the tokenizer has no {role} token")
        return self.backend.id_to_token(self.role_ids[role])

    def _ascii_backend(self, lowercase: bool) -> Tokenizer | None:
        """A copy for printable ASCII texts, where BERT's normalizer (control characters
        removed, CJK characters spaced, accents stripped, lowercasing) comes down to lowercasing
        or nothing: the same ids for nearly all English traffic at 16 instead of 25 us a short
        text. None for other normalizers. Added tokens are matched as in the full tokenizer,
        before normalizing or after it, as each is declared."""
        serialized = self.backend.to_str()  # megabytes for a large vocabulary: once
        normalizer = json.loads(serialized).get("normalizer") or {}
        steps = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
        if [step.get("type") for step in steps] not in (["BertNormalizer"], ["Lowercase", "BertNormalizer"]):
            return None
        copy = Tokenizer.from_str(serialized)
        lower = lowercase or steps[-1].get("lowercase", True)
        copy.normalizer = normalizers.Lowercase() if lower else None
        return copy

    def _special_tokens_around(self) -> tuple[list[int], list[int]]:
        """The special ids the post-processor puts before and after one sequence."""
        body = self.backend.encode("a", add_special_tokens=False)
        full = self.backend.post_process(body, None, True).ids
        for start in range(len(full) - len(body.ids) + 1):
            if full[start : start + len(body.ids)] == body.ids:
                return full[:start], full[start + len(body.ids) :]
        raise ModelFilesError("cannot locate the text among the tokenizer's special tokens")

    def body_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids without special tokens, nothing truncated."""
        texts = list(texts)
        if self.ascii_backend is None:
            return _ids(self.backend, texts)
        plain = [text.isascii() and text.isprintable() for text in texts]
        if all(plain):
            return _ids(self.ascii_backend, texts)
        fast = iter(_ids(self.ascii_backend, [text for text, p in zip(texts, plain) if p]))
        full = iter(_ids(self.backend, [text for text, p in zip(texts, plain) if not p]))
        return [next(fast) if p else next(full) for p in plain]

    def body_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Token ids without special tokens and each token's [start, end) characters in its text."""
        return [(encoding.ids, encoding.offsets)
                for encoding in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def token_name(self, token_id: int) -> str:
        """The vocabulary's token of an id (the id itself where the vocabulary has none)."""
        return self.backend.id_to_token(token_id) or str(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def prompt_length(self, prompt: str) -> int:
        """The prompt's tokens, special tokens in front included, the trailing one not: what
        sentence-transformers leaves out of pooling when a Pooling module excludes the prompt."""
        ids = self.prefix + self.body_ids([prompt])[0] + self.suffix
        return len(ids) - 1 if ids and ids[-1] in self.special_ids else len(ids)

    def assemble(self, body: Sequence[int], max_length: int, direction: str, keep: int = 0) -> Tokenized:
        """Wrap a body in special tokens, cutting it on `direction` so the result fits max_length;
        the first `keep` tokens of the body (a prompt) are never cut."""
        specials = len(self.prefix) + len(self.suffix)
        full_length = len(body) + specials
        room = max(0, max_length - specials)
        if len(body) > room:
            keep = min(keep, room)
            text_room = room - keep
            if direction == "left":
                body = list(body[:keep]) + list(body[len(body) - text_room :] if text_room else [])
            else:
                body = body[:room]
        return Tokenized(self.prefix + list(body) + self.suffix, full_length)

    def pairs(self, pairs: Sequence[tuple[str, str | None]], max_length: int, direction: str) -> list[Tokenized]:
        """Texts and (query, document) pairs as a scoring model takes them: what
        `tokenizer(queries, documents, truncation="longest_first", max_length=...)` gives, as
        sentence-transformers' CrossEncoder calls it (the longer text is cut first, token by
        token), with the full length for "too long" errors."""
        pairs = [(first, second) if second is not None else first for first, second in pairs]
        full = self.backend.encode_batch(pairs, add_special_tokens=True)
        long = [i for i, encoding in enumerate(full) if len(encoding.ids) > max_length]
        cut = dict(zip(long, self._truncating(max_length, direction).encode_batch([pairs[i] for i in long],
                                                                                 add_special_tokens=True)))
        served = [cut.get(i, encoding) for i, encoding in enumerate(full)]
        return [Tokenized(used.ids, len(encoding.ids), _second_segment(used.type_ids) if self.token_types else 0)
                for used, encoding in zip(served, full)]

    def _truncating(self, max_length: int, direction: str) -> Tokenizer:
        """A copy that truncates pairs longest-first to max_length, kept per length and side."""
        key = (max_length, direction)
        if key not in self._truncating_copies:
            copy = Tokenizer.from_str(self.backend.to_str())
            copy.enable_truncation(max_length, strategy="longest_first", direction=direction)
            self._truncating_copies[key] = copy
        return self._truncating_copies[key]

    def tokens(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[dict]]:
        """TEI's /tokenize answer: id, text, special, and character offsets per token."""
        result = []
        for encoding in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens):
            result.append([
                {"id": token_id, "text": text, "special": bool(special),
                 "start": None if special else start, "stop": None if special else stop}
                for token_id, text, special, (start, stop) in zip(
                    encoding.ids, encoding.tokens, encoding.special_tokens_mask, encoding.offsets)
            ])
        return result


def _second_segment(type_ids: Sequence[int]) -> int:
    """Where token type 1 starts; the tokenizer's template puts it on the second text and its
    special tokens, to the end (BERT: [CLS] a [SEP] b [SEP], types 0...0 1...1)."""
    try:
        start = list(type_ids).index(1)
    except ValueError:
        return 0
    if any(kind != 1 for kind in type_ids[start:]):
        raise ModelFilesError("the tokenizer's pair template gives token types other than 0...0 1...1")
    return start


def _ids(backend: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)] if texts else []
