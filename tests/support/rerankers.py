"""Tiny random scoring models, made offline like the embedding families (model_families.py):
real architectures of transformers with random weights, real tokenizers trained here, saved the
way sentence-transformers 6 saves a CrossEncoder.

    bert        BERT cross-encoder, [CLS] a [SEP] b [SEP] with token types 0/1, one label, Sigmoid:
                the ms-marco-MiniLM-L-6-v2 shape
    xlmr        XLM-RoBERTa cross-encoder, <s> a </s></s> b </s>, no token types: the
                bge-reranker-v2-m3 shape (positions offset by 2)
    classifier  BERT, three labels with names, Identity: a multi-label classifier
    bert_hf     the BERT cross-encoder as a plain Hugging Face folder, no sentence-transformers files
    qwen3       Qwen3 causal language model reranker: pairs rendered by a chat template of the
                Qwen3-Reranker shape (system prompt, <Instruct>, <Query>, <Document>, the assistant's
                empty thinking), scored by LogitScore as logit("yes") - logit("no"), Sigmoid;
                160 tokens at most, so long pairs are cut and get the template's tail back
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast, Qwen3Config, \
    Qwen3ForCausalLM, XLMRobertaConfig, XLMRobertaForSequenceClassification

from tests.support.model_families import HIDDEN, _save_tokenizer, _wordpiece, _xlmr_tokenizer, corpus

RERANKERS = ("bert", "xlmr", "classifier", "bert_hf", "qwen3")
# Qwen3-Reranker's shape of template: an instruction (the "system" message, else a default), the
# query and the document, then the assistant's turn with an empty thinking block.
QWEN_RERANK_TEMPLATE = (
    '{%- set system = messages | selectattr("role", "eq", "system") | map(attribute="content") | first -%}'
    '{%- set query = messages | selectattr("role", "eq", "query") | map(attribute="content") | first -%}'
    '{%- set document = messages | selectattr("role", "eq", "document") | map(attribute="content") | first -%}'
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    '<Instruct>: {{ system or "Given a web search query, retrieve relevant passages that answer the query" }}\n'
    '<Query>: {{ query }}\n<Document>: {{ document }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')
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


def _qwen_chat_tokenizer(path: Path, max_length: int):
    """Qwen's byte-level BPE with the chat tokens, "yes" and "no" whole tokens (LogitScore's), and
    the reranker's chat template; left padding, as sentence-transformers pads a causal model."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus() + ["yes", "no"] * 50, trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", padding_side="left",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = QWEN_RERANK_TEMPLATE
    fast.save_pretrained(path)
    return fast


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
    elif family == "qwen3":
        tokenizer = _qwen_chat_tokenizer(raw, 160)
        model = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), num_key_value_heads=2, head_dim=8, max_position_embeddings=192,
            bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, **small))
    elif family == "xlmr":
        tokenizer = _xlmr_tokenizer(raw, 64)
        model = XLMRobertaForSequenceClassification(XLMRobertaConfig(
            vocab_size=len(tokenizer), max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            num_labels=1, **small))
    else:
        raise ValueError(f"unknown reranker family {family}; known: {', '.join(RERANKERS)}")
    with torch.no_grad():  # a spread of scores: random heads start near zero
        for parameter in (model.classifier if family != "qwen3" else model.lm_head).parameters():
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
