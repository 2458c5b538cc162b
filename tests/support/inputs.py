"""Inputs the tests embed: varied texts (short, past the max length, non-ASCII) and token rows."""

import random

SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome!",
    "Embeddings map text to vectors that capture meaning.",
    "¿Dónde está la biblioteca?",
    "Ich liebe maschinelles Lernen und große Sprachmodelle.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "emoji 🚀🔥 and symbols ∑∫√ mixed with text",
    "x",
    "OK",
    "   leading and trailing spaces   ",
    "Line one\nLine two\tTabbed",
    "URLs like https://example.com/path?q=1 and e-mails like a@b.co",
    "Numbers 3.14159 2.71828 1e-10 and 42",
]


def varied_texts(count=120, seed=7):
    """Short, long (past the 256-token limit) and non-ASCII texts, deterministic."""
    rng = random.Random(seed)
    words = " ".join(SENTENCES).split()
    texts = list(SENTENCES)
    while len(texts) < count:
        length = rng.choice([1, 3, 8, 20, 60, 150, 400])
        texts.append(" ".join(rng.choice(words) for _ in range(length)))
    return texts


def random_rows(model, lengths, seed=0):
    """Token ids of the given lengths, never the padding id (positions skip it in RoBERTa models)."""
    rng = random.Random(seed)
    tokens = [i for i in range(3, model.config.vocab_size) if i != model.config.pad_token_id]
    return [rng.choices(tokens, k=n) for n in lengths]
