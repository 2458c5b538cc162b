"""Tiny random models of the families users deploy, with their sentence-transformers pipelines,
made offline: each is a real architecture of transformers with random weights, a real tokenizer
trained here on a small corpus, and the pipeline files sentence-transformers 6 itself saves.

    bert_dense    BERT, CLS pooling, Dense (tanh), Normalize: the LaBSE / bge shape
    xlmr          XLM-RoBERTa, Unigram (sentencepiece-style) tokenizer, mean pooling, Normalize,
                  "query: " / "passage: " prompts: the multilingual-e5 shape (positions offset by 2)
    mpnet         MPNet, mean pooling, Normalize: the all-mpnet-base-v2 shape
    qwen3         Qwen3 decoder, byte-level BPE, the EOS token appended, last-token pooling,
                  left padding, an instruction prompt: the Qwen3-Embedding shape
    modernbert    ModernBERT (rotary, local/global attention), mean pooling, LayerNorm, Normalize

At the end, what the tests check the families' vectors with: texts, the least cosine to
sentence-transformers' vectors, and sentence-transformers' pipeline on exact token ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig, BertModel, MPNetConfig, MPNetModel, ModernBertConfig, ModernBertModel, PreTrainedTokenizerFast,
    Qwen3Config, Qwen3Model, XLMRobertaConfig, XLMRobertaModel,
)

FAMILIES = ("bert_dense", "xlmr", "mpnet", "qwen3", "modernbert")

QWEN_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def corpus(count: int = 400, seed: int = 3) -> list[str]:
    """Training text for the tokenizers: English, accents, CJK, digits and punctuation."""
    rng = random.Random(seed)
    words = ("the a of to and in is it that for on with as was by at this are from or have not query passage "
             "embedding model server batch request token text vector search document cat dog sat mat hello "
             "world fast slow long short red green blue one two three instruct given web retrieve relevant "
             "passages answer Query Instruct café naïve über straße 東京 日本 语言 москва 42 3.14 , . ! ? : ; - ( )"
             ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(count)]


def _wordpiece(specials: list[str], unk: str) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(corpus(), trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
    return tokenizer


def _template(tokenizer: Tokenizer, first: str, last: str) -> None:
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=f"{first} $A {last} {last} $B {last}",
        special_tokens=[(first, tokenizer.token_to_id(first)), (last, tokenizer.token_to_id(last))])


def _save_tokenizer(tokenizer: Tokenizer, path: Path, max_length: int, **special) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length, **special)
    fast.save_pretrained(path)
    return fast


def _bert_tokenizer(path: Path, max_length: int) -> PreTrainedTokenizerFast:
    tokenizer = _wordpiece(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], unk="[UNK]")
    _template(tokenizer, "[CLS]", "[SEP]")
    return _save_tokenizer(tokenizer, path, max_length, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                           sep_token="[SEP]", mask_token="[MASK]")


def _xlmr_tokenizer(path: Path, max_length: int) -> PreTrainedTokenizerFast:
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # XLM-R's ids: <s>=0, <pad>=1, </s>=2
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(corpus(), trainers.UnigramTrainer(vocab_size=300, special_tokens=specials,
                                                                   unk_token="<unk>"))
    _template(tokenizer, "<s>", "</s>")
    return _save_tokenizer(tokenizer, path, max_length, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                           unk_token="<unk>", cls_token="<s>", sep_token="</s>", mask_token="<mask>")


def _mpnet_tokenizer(path: Path, max_length: int) -> PreTrainedTokenizerFast:
    tokenizer = _wordpiece(["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk="<unk>")  # MPNet: <s>=0, <pad>=1, </s>=2
    _template(tokenizer, "<s>", "</s>")
    return _save_tokenizer(tokenizer, path, max_length, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                           unk_token="<unk>", cls_token="<s>", sep_token="</s>", mask_token="<mask>")


def _qwen_tokenizer(path: Path, max_length: int) -> PreTrainedTokenizerFast:
    eos = "<|endoftext|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=500, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # Qwen3-Embedding's tokenizer appends the end-of-text token; the embedding is that token's state.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, tokenizer.token_to_id(eos))])
    return _save_tokenizer(tokenizer, path, max_length, eos_token=eos, pad_token=eos, padding_side="left")


def _st_files(path: Path, modules: list[tuple[str, dict, dict[str, torch.Tensor] | None]], max_seq_length: int,
              prompts: dict[str, str] | None = None, default_prompt_name: str | None = None) -> None:
    """modules.json and each module's folder, in sentence-transformers 6's own names and files.
    `modules`: (type name under sentence_transformers, config, weights or None) after the Transformer."""
    from safetensors.torch import save_file

    entries = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.base.modules.transformer.Transformer"}]
    for idx, (kind, config, weights) in enumerate(modules, start=1):
        folder = f"{idx}_{kind.rsplit('.', 1)[-1]}"
        entries.append({"idx": idx, "name": str(idx), "path": folder, "type": f"sentence_transformers.{kind}"})
        (path / folder).mkdir(exist_ok=True)
        (path / folder / "config.json").write_text(json.dumps(config))
        if weights is not None:
            save_file(weights, str(path / folder / "model.safetensors"))
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                "do_lower_case": False}))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts or {}, "default_prompt_name": default_prompt_name, "similarity_fn_name": "cosine"}))


POOLING = "sentence_transformer.modules.pooling.Pooling"
DENSE = "base.modules.dense.Dense"
NORMALIZE = "base.modules.normalize.Normalize"
LAYER_NORM = "sentence_transformer.modules.layer_norm.LayerNorm"


def _pooling(dimension: int, mode: str, include_prompt: bool = True):
    return (POOLING, {"embedding_dimension": dimension, "pooling_mode": mode, "include_prompt": include_prompt},
            None)


def _dense(in_features: int, out_features: int, activation: str = "torch.nn.modules.activation.Tanh"):
    weights = {"linear.weight": torch.randn(out_features, in_features) * 0.3, "linear.bias": torch.randn(out_features)}
    return (DENSE, {"in_features": in_features, "out_features": out_features, "bias": True,
                    "activation_function": activation}, weights)


def _layer_norm(dimension: int):
    return (LAYER_NORM, {"dimension": dimension},
            {"norm.weight": 1 + torch.randn(dimension) * 0.2, "norm.bias": torch.randn(dimension) * 0.2})


NORMALIZE_MODULE = (NORMALIZE, {}, None)
HIDDEN = 32


def make_family(family: str, path: Path, *, seed: int = 0) -> Path:
    """Write the tiny model of `family` (one of FAMILIES) to `path` and return it."""
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    small = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "bert_dense":
        tokenizer = _bert_tokenizer(path, 128)
        model = BertModel(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=128, **small))
        pipeline = [_pooling(HIDDEN, "cls"), _dense(HIDDEN, 24), NORMALIZE_MODULE]
        st = dict(max_seq_length=64)
    elif family == "xlmr":
        tokenizer = _xlmr_tokenizer(path, 64)
        # 66 position embeddings, 64 usable: positions start after the padding id (1), as in XLM-R's 514/512.
        model = XLMRobertaModel(XLMRobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=66,
                                                 pad_token_id=1, bos_token_id=0, eos_token_id=2, **small))
        pipeline = [_pooling(HIDDEN, "mean"), NORMALIZE_MODULE]
        st = dict(max_seq_length=64, prompts={"query": "query: ", "passage": "passage: "})
    elif family == "mpnet":
        tokenizer = _mpnet_tokenizer(path, 64)
        model = MPNetModel(MPNetConfig(vocab_size=len(tokenizer), max_position_embeddings=66, pad_token_id=1,
                                       bos_token_id=0, eos_token_id=2, **small))
        pipeline = [_pooling(HIDDEN, "mean"), NORMALIZE_MODULE]
        st = dict(max_seq_length=48)
    elif family == "qwen3":
        tokenizer = _qwen_tokenizer(path, 256)
        eos = tokenizer.eos_token_id
        model = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=256, bos_token_id=eos, eos_token_id=eos,
                                       pad_token_id=eos, tie_word_embeddings=False, **small))
        pipeline = [_pooling(HIDDEN, "lasttoken"), NORMALIZE_MODULE]
        st = dict(max_seq_length=64, prompts={"query": QWEN_PROMPT, "document": ""})
    elif family == "modernbert":
        tokenizer = _bert_tokenizer(path, 512)
        model = ModernBertModel(ModernBertConfig(
            vocab_size=len(tokenizer), max_position_embeddings=512, global_attn_every_n_layers=2,
            local_attention=16, pad_token_id=tokenizer.pad_token_id, cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id, **small))
        pipeline = [_pooling(HIDDEN, "mean"), _layer_norm(HIDDEN), NORMALIZE_MODULE]
        st = dict(max_seq_length=96)
    else:
        raise ValueError(f"unknown family {family}; known: {', '.join(FAMILIES)}")
    model.eval().save_pretrained(path)
    _st_files(path, pipeline, **st)
    return path


# --- Checking the families' vectors against sentence-transformers -------------------------------

MIN_COSINE = 0.9999

TEXTS = [
    "hello world",
    "the cat sat on the mat café",
    "x",
    "Query: answer one two three, naïve über straße! " * 12,  # over every family's max length
    "東京 日本 42 3.14 !",
    "  leading and trailing spaces  ",
]


def min_cosine(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(((got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)).min())


def st_on_ids(reference, rows, prompt_length=None) -> np.ndarray:
    """sentence-transformers' whole pipeline on exact token ids, one input at a time (no padding)."""
    vectors = []
    with torch.no_grad():
        for ids in rows:
            features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                        "modality": "text"}
            if prompt_length:
                features["prompt_length"] = prompt_length
            vectors.append(reference.forward(features)["sentence_embedding"][0].numpy())
    return np.stack(vectors)
