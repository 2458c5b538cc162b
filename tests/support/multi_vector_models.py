"""Tiny random ColBERT-style models made offline with sentence-transformers' own classes and saved
with its own `save`, and the reference's token vectors and MaxSim scores for them.

The pipeline is the one sentence-transformers 6 builds for a new MultiVectorEncoder: Transformer
(with query_length / document_length / query_expansion), a bias-free linear Dense on the token
embeddings, MultiVectorMask (the scoring mask and the skiplist), Normalize on the token
embeddings. The query and document prefixes are "[Q] " and "[D] " prompts, "[Q]" and "[D]" being
tokens of the vocabulary, so each is one token right after [CLS], as in PyLate's ColBERT models.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken
from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaModel

from tests.support.model_families import _bert_tokenizer, _xlmr_tokenizer

PREFIXES = {"query": "[Q] ", "document": "[D] "}
DIMENSION = 16  # the projection's width (ColBERT's is 128)


def make_colbert(path: Path, *, family: str = "bert", query_length: int = 12, document_length: int = 24,
                 expansion: bool | str = True, attend: bool = False, skiplist: bool = True,
                 pool_factor: float | None = None, seed: int = 0) -> Path:
    """A MultiVectorEncoder of a tiny random BERT (or XLM-R: `family="xlmr"`), saved by
    sentence-transformers to `path`.

    expansion: queries are padded to exactly `query_length` tokens with the mask token, which the
    encoder does not attend to (`attend=True`: does), and every position is scored; "min": padded
    up to `query_length` but a longer query is kept whole; False: `query_length` only truncates.
    skiplist: documents' punctuation tokens are not returned.
    pool_factor: bake a HierarchicalTokenPooling of documents into the pipeline."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling, MultiVectorMask

    raw = path.parent / f"{path.name}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "bert":
        tokenizer = _bert_tokenizer(raw, 128)
    elif family == "xlmr":
        tokenizer = _xlmr_tokenizer(raw, 128)
    else:
        raise ValueError(f"unknown family {family}")
    # The prefixes as single tokens: not normalized, or the lowercasing normalizer would never match "[Q]".
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken(prefix.strip(), normalized=False, special=True) for prefix in PREFIXES.values()]})
    tokenizer.save_pretrained(raw)
    if family == "bert":
        model = BertModel(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=128, **small))
    else:
        model = XLMRobertaModel(XLMRobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=130,
                                                 pad_token_id=1, bos_token_id=0, eos_token_id=2, **small))
    model.eval().save_pretrained(raw)

    query_expansion = None
    if expansion:
        strategy = "fixed" if expansion is True else expansion
        query_expansion = {"strategy": strategy, "attend": attend, "length": query_length}
    # Under "min" the expansion length is only the floor: the ceiling is the tokenizer's length.
    transformer = Transformer(str(raw), query_length=None if expansion == "min" else query_length,
                              document_length=document_length, query_expansion=query_expansion)
    modules = [
        transformer,
        Dense(32, DIMENSION, bias=False, activation_function=torch.nn.Identity(), module_input_name="token_embeddings"),
        MultiVectorMask(skiplist_words=list(string.punctuation) if skiplist else None),
        Normalize(module_input_name="token_embeddings"),
    ]
    if pool_factor is not None:
        modules.append(HierarchicalTokenPooling(pool_factor=pool_factor))
    encoder = MultiVectorEncoder(modules=modules, prompts=dict(PREFIXES), similarity_fn_name="maxsim", device="cpu")
    encoder.save(str(path))
    return path


def _load(model_dir: Path):
    from sentence_transformers import MultiVectorEncoder

    return MultiVectorEncoder(str(model_dir), device="cpu", local_files_only=True)


def reference_tokens(model_dir: Path, texts: list[str], kind: str | None = "query") -> list[np.ndarray]:
    """sentence-transformers' encode_query / encode_document / encode (kind None) of `texts`: a
    (tokens, dim) array per text."""
    encoder = _load(model_dir)
    encode = {"query": encoder.encode_query, "document": encoder.encode_document, None: encoder.encode}[kind]
    return encode(texts, convert_to_numpy=True)


def reference_maxsim(model_dir: Path, query: str, documents: list[str]) -> np.ndarray:
    """sentence-transformers' similarity of `query` (encoded as a query) with each of `documents`."""
    encoder = _load(model_dir)
    scores = encoder.similarity(encoder.encode_query([query]), encoder.encode_document(documents))
    return scores[0].numpy()
