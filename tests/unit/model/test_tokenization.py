"""The tokenizer's printable-ASCII shortcut gives exactly the full tokenizer's ids, in order, for
every kind of text, and is used only where the normalizer allows it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, BertTokenizerFast

from embedserve.handler.model.tokenization import TextTokenizer
from tests.support.tiny_model import make_tiny_model

TEXTS = [
    "Hello, World! 42 apples; 3.14 (pi)", "the Of IN that", "", "   ", "x" * 300,
    "[CLS] Hello [SEP] [MASK] world [mask] [Cls]",  # added tokens, as declared and not
    "a\tb\nc\r d", "nul\x00byte", "del\x7fchar", "vertical\x0btab",  # ASCII but not printable
    "café naïve über straße", "日本語 漢字", "mixed é and e", "\u00a0non-breaking\u200bspace",
    "UPPER lower MiXeD", "#hash ##piece @at ~tilde `tick",
]


@pytest.fixture(scope="module")
def cased_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("models") / "cased")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=False).save_pretrained(path)
    return path


def full_ids(tokenizer: TextTokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.backend.encode_batch_fast(texts, add_special_tokens=False)]


@pytest.mark.parametrize("kind", ["uncased", "cased", "lowercased by the pipeline"])
def test_ascii_shortcut_gives_the_full_tokenizers_ids(kind, tiny_model_dir, cased_dir):
    model_dir = tiny_model_dir if kind == "uncased" else cased_dir
    tokenizer = TextTokenizer(model_dir, lowercase=kind == "lowercased by the pipeline")
    assert tokenizer.ascii_backend is not None and (tokenizer.ascii_backend.normalizer is None) == (kind == "cased")
    expected = full_ids(tokenizer, TEXTS)
    if kind != "lowercased by the pipeline":
        hf = AutoTokenizer.from_pretrained(model_dir)
        assert expected == [hf(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    assert tokenizer.body_ids(TEXTS) == expected  # mixed batch, order kept
    for text, ids in zip(TEXTS, expected):
        assert tokenizer.body_ids([text]) == [ids]
    assert tokenizer.body_ids([]) == []


@pytest.mark.parametrize("family", ["xlmr", "qwen3", "bert_dense", "mpnet"])
def test_only_bert_normalizers_take_the_shortcut(family, families):
    tokenizer = TextTokenizer(families[family])
    assert (tokenizer.ascii_backend is not None) == (family in ("bert_dense", "mpnet"))
    assert tokenizer.body_ids(TEXTS) == full_ids(tokenizer, TEXTS)
