"""Tiny random SPLADE models made offline with sentence-transformers' own classes and saved with
its own `save`, and the reference's sparse vectors for them.

A random masked-language head activates nearly the whole vocabulary; a trained SPLADE model keeps
a few hundred entries a text. The head's output bias is set far below zero but on ACTIVE ids, so
each vector has a trained model's sparsity (and the answers stay small).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM, XLMRobertaConfig, XLMRobertaForMaskedLM

from tests.support.model_families import _bert_tokenizer, _xlmr_tokenizer

ACTIVE = 64  # vocabulary ids a text can activate


def make_splade(path: Path, *, family: str = "bert", strategy: str = "max", activation: str = "relu",
                seed: int = 0, max_seq_length: int = 64) -> Path:
    """A SparseEncoder (a fill-mask Transformer, then SpladePooling) of a tiny random BERT or
    XLM-R, saved by sentence-transformers to `path`."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sparse_encoder.models import SpladePooling

    raw = path.parent / f"{path.name}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if family == "bert":
        tokenizer = _bert_tokenizer(raw, max_seq_length)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=128, type_vocab_size=2)
        model = BertForMaskedLM(config)
        bias = model.cls.predictions.bias
    elif family == "xlmr":
        tokenizer = _xlmr_tokenizer(raw, max_seq_length)
        config = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=130,
                                  pad_token_id=1, bos_token_id=0, eos_token_id=2)
        model = XLMRobertaForMaskedLM(config)
        bias = model.lm_head.bias
    else:
        raise ValueError(f"unknown family {family}")
    with torch.no_grad():
        active = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))[:ACTIVE]
        bias.fill_(-30.0)
        bias[active] = 0.0
    model.eval().save_pretrained(raw)
    transformer = Transformer(str(raw), transformer_task="fill-mask", max_seq_length=max_seq_length)
    encoder = SparseEncoder(modules=[transformer, SpladePooling(pooling_strategy=strategy,
                                                                activation_function=activation)], device="cpu")
    encoder.save(str(path))
    return path


def make_inference_free(path: Path, *, seed: int = 0) -> Path:
    """An inference-free SparseEncoder: a Router whose query side is a SparseStaticEmbedding
    (random positive weights on a third of the vocabulary, zero elsewhere) and whose document side
    is a SPLADE model, saved by sentence-transformers to `path`."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules.router import Router
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sparse_encoder.models import SparseStaticEmbedding, SpladePooling
    from transformers import AutoTokenizer

    make_splade(path.parent / f"{path.name}-splade", seed=seed)
    raw = path.parent / f"{path.name}-splade-raw"
    tokenizer = AutoTokenizer.from_pretrained(raw)
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(len(tokenizer), generator=generator) * (torch.rand(len(tokenizer), generator=generator) < 0.33)
    router = Router.for_query_document(
        query_modules=[SparseStaticEmbedding(tokenizer, weight=weights, frozen=True)],
        document_modules=[Transformer(str(raw), transformer_task="fill-mask"), SpladePooling("max")])
    SparseEncoder(modules=[router], device="cpu").save(str(path))
    return path


def reference_sparse(model_dir: Path, texts: list[str], kind: str | None = None, **kwargs) -> list[dict[int, float]]:
    """sentence-transformers' SparseEncoder.encode (encode_query, encode_document: `kind`) of
    `texts`: {token id: weight} per text."""
    from sentence_transformers import SparseEncoder

    encoder = SparseEncoder(str(model_dir), device="cpu", local_files_only=True)
    encode = {None: encoder.encode, "query": encoder.encode_query, "document": encoder.encode_document}[kind]
    dense = encode(texts, convert_to_tensor=True, **kwargs).to_dense().numpy()
    return [{int(i): float(row[i]) for i in np.flatnonzero(row)} for row in dense]


def served_sparse(answer: list[list[dict]]) -> list[dict[int, float]]:
    """TEI's /embed_sparse answer as {token id: weight} per text."""
    return [{entry["index"]: entry["value"] for entry in row} for row in answer]


def assert_same_sparse(got: list[dict[int, float]], want: list[dict[int, float]], tolerance: float = 1e-4) -> float:
    """Same non-zero ids per vector, weights within `tolerance`; the largest difference."""
    worst = 0.0
    for i, (row, expected) in enumerate(zip(got, want, strict=True)):
        assert sorted(row) == sorted(expected), f"vector {i}: ids differ"
        worst = max([worst, *(abs(row[k] - expected[k]) for k in row)])
    assert worst <= tolerance, worst
    return worst
