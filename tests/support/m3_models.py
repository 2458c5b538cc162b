"""Tiny random bge-m3-shaped models made offline, and FlagEmbedding's BGEM3 embedder (the
reference for bge-m3's three outputs) run on them.

A bge-m3 folder is an XLM-R encoder with sentence-transformers files (CLS pooling, Normalize: the
dense vector) and two heads beside it, as pickled state dicts: `sparse_linear.pt` (hidden -> 1, a
weight per token) and `colbert_linear.pt` (hidden -> hidden, a vector per token).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import XLMRobertaConfig, XLMRobertaModel

from embedserve.archive.smoke import m3_embedder_class
from tests.support.model_families import _xlmr_tokenizer

MAX_LENGTH = 64


def make_m3(path: Path, *, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = _xlmr_tokenizer(path, MAX_LENGTH)
    config = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=130, pad_token_id=1, bos_token_id=0,
                              eos_token_id=2)
    XLMRobertaModel(config, add_pooling_layer=False).eval().save_pretrained(path)
    sparse = torch.nn.Linear(32, 1)
    with torch.no_grad():
        sparse.bias.fill_(0.3)  # most tokens weigh something, as in a trained model
    torch.save(sparse.state_dict(), path / "sparse_linear.pt")
    torch.save(torch.nn.Linear(32, 32).state_dict(), path / "colbert_linear.pt")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                "pooling_mode_cls_token": True}))
    (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_LENGTH}))
    return path


def reference_m3(model_dir: Path, texts: list[str]) -> dict:
    """BGEM3's dense vectors, lexical weights ({token id: weight}) and ColBERT vectors of `texts`."""
    embedder = m3_embedder_class()(str(model_dir), use_fp16=False, devices="cpu", normalize_embeddings=True)
    out = embedder.encode(texts, batch_size=16, max_length=MAX_LENGTH, return_dense=True, return_sparse=True,
                          return_colbert_vecs=True)
    return {"dense": np.asarray(out["dense_vecs"]),
            "sparse": [{int(k): float(v) for k, v in weights.items()} for weights in out["lexical_weights"]],
            "colbert": [np.asarray(vectors) for vectors in out["colbert_vecs"]]}
