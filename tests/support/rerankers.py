"""Tiny random scoring models, made offline like the embedding families (model_families.py):
real architectures of transformers with random weights, real tokenizers trained here, saved the
way sentence-transformers 6 saves a CrossEncoder.

    bert        BERT cross-encoder, [CLS] a [SEP] b [SEP] with token types 0/1, one label, Sigmoid:
                the ms-marco-MiniLM-L-6-v2 shape
    xlmr        XLM-RoBERTa cross-encoder, <s> a </s></s> b </s>, no token types: the
                bge-reranker-v2-m3 shape (positions offset by 2)
    classifier  BERT, three labels with names, Identity: a multi-label classifier
    bert_hf     the BERT cross-encoder as a plain Hugging Face folder, no sentence-transformers files
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from tokenizers import processors
from transformers import BertConfig, BertForSequenceClassification, XLMRobertaConfig, \
    XLMRobertaForSequenceClassification

from tests.support.model_families import HIDDEN, _save_tokenizer, _wordpiece, _xlmr_tokenizer

RERANKERS = ("bert", "xlmr", "classifier", "bert_hf")
LABELS = ("negative", "neutral", "positive")


def _bert_pair_tokenizer(path: Path, max_length: int):
    tokenizer = _wordpiece(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], unk="[UNK]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")), ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    # BERT's tokenizer hands the model token types: the second text's are 1.
    return _save_tokenizer(tokenizer, path, max_length, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                           sep_token="[SEP]", mask_token="[MASK]",
                           model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def make_reranker(family: str, path: Path, *, seed: int = 0) -> Path:
    """Write the tiny scoring model of `family` (one of RERANKERS) to `path` and return it."""
    from sentence_transformers import CrossEncoder

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    small = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    raw = path.parent / f".{path.name}-hf"
    raw.mkdir(parents=True, exist_ok=True)
    if family in ("bert", "bert_hf", "classifier"):
        tokenizer = _bert_pair_tokenizer(raw, 96)
        labels = {"num_labels": 3, "id2label": dict(enumerate(LABELS)), "label2id": {n: i for i, n in
                                                                                       enumerate(LABELS)}} \
            if family == "classifier" else {"num_labels": 1}
        model = BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=128,
                                                         **labels, **small))
    elif family == "xlmr":
        tokenizer = _xlmr_tokenizer(raw, 64)
        model = XLMRobertaForSequenceClassification(XLMRobertaConfig(
            vocab_size=len(tokenizer), max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            num_labels=1, **small))
    else:
        raise ValueError(f"unknown reranker family {family}; known: {', '.join(RERANKERS)}")
    with torch.no_grad():  # a spread of scores: random heads start near zero
        for parameter in model.classifier.parameters():
            parameter.mul_(40)
    model.eval().save_pretrained(raw)
    if family == "bert_hf":
        shutil.copytree(raw, path, dirs_exist_ok=True)
    else:
        CrossEncoder(str(raw)).save(str(path))
    shutil.rmtree(raw)
    return path


PAIRS = [
    ("hello world", "the cat sat on the mat"),
    ("query one two three", "a dog"),
    ("x", "東京 日本 42 3.14 !"),
    ("fast model server", "batch request token text vector search document " * 12),  # over max length
    ("café naïve über straße " * 10, "short"),  # a long query
    ("the", "the"),
]


def reference_scores(model_dir: Path, pairs=PAIRS, **kwargs) -> np.ndarray:
    """sentence-transformers' CrossEncoder.predict on the pairs, as a user runs it."""
    from sentence_transformers import CrossEncoder

    return np.asarray(CrossEncoder(str(model_dir)).predict(pairs, batch_size=4, **kwargs), dtype=np.float64)
