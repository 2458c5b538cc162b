"""Synthetic corpora, generated offline and deterministically from the model's own vocabulary,
for int8 calibration at build time and for the benchmark.

- fixed: every text is exactly `length` tokens with special tokens (64 by default);
- mixed: a long tail from 4 to 256 tokens, median about 40 (log-normal lengths), like real
  retrieval traffic: many short queries and titles, some long passages.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(tokenizer_file: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()  # tokenizer.json files may pad and truncate on their own
    tokenizer.no_padding()
    return tokenizer


def vocabulary_words(tokenizer: Tokenizer) -> list[str]:
    """Whole lowercase words of the vocabulary, sorted so the choice is reproducible."""
    return sorted(w for w in tokenizer.get_vocab() if re.fullmatch(r"[a-z]{3,12}", w))


def text_of_length(tokenizer: Tokenizer, words: list[str], rng: random.Random, tokens: int) -> str:
    """A text of exactly `tokens` tokens, special tokens included: whole words while they fit,
    then one-token words to fill."""
    specials = tokenizer.post_processor.num_special_tokens_to_add(False) if tokenizer.post_processor else 0
    target = max(1, tokens - specials)
    chosen: list[str] = []
    count = 0
    while count < target:
        word = rng.choice(words)
        pieces = len(tokenizer.encode(word, add_special_tokens=False).ids)
        if count + pieces > target:
            word, pieces = "a", 1
        chosen.append(word)
        count += pieces
    return " ".join(chosen)


def fixed_corpus(tokenizer_file: Path, count: int, length: int = 64, seed: int = 0) -> list[str]:
    tokenizer = load_tokenizer(tokenizer_file)
    words, rng = vocabulary_words(tokenizer), random.Random(seed)
    return [text_of_length(tokenizer, words, rng, length) for _ in range(count)]


def mixed_lengths(count: int, seed: int = 0, median: int = 36, lo: int = 4, hi: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(0, 0.9) * median))) for _ in range(count)]


def mixed_corpus(tokenizer_file: Path, count: int, seed: int = 0) -> list[str]:
    tokenizer = load_tokenizer(tokenizer_file)
    words, rng = vocabulary_words(tokenizer), random.Random(seed + 1)
    return [text_of_length(tokenizer, words, rng, n) for n in mixed_lengths(count, seed)]
