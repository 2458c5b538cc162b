"""A tiny random BERT with a real WordPiece tokenizer and sentence-transformers files, made offline."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

WORDS = (
    "the a an of to and in is it that for on with as was by at be this are from or have not "
    "embedding model server batch request token text vector search query document cat dog sat "
    "mat hello world fast slow long short red green blue one two three four five six seven"
).split()

# The prompts of the session's tiny model (tests/conftest.py's tiny_model_dir).
PROMPTS = {"query": "query: ", "document": "document: "}


def _vocab() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation) + list("éèàüöäßçñ漢字日本語ü")
    return specials + sorted(set(WORDS)) + chars + ["##" + c for c in string.ascii_lowercase + string.digits]


def make_tiny_model(
    path: Path,
    *,
    pooling: str = "mean",
    sentence_transformers_files: bool = True,
    weights: str = "safetensors",
    max_seq_length: int = 48,
    seed: int = 0,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> Path:
    """Write a tiny BERT (hidden 32, 2 layers) to `path`; `weights` is "safetensors" or "bin"."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(_vocab()) + "\n")
    tokenizer = BertTokenizerFast.from_pretrained(path, model_max_length=64)
    tokenizer.save_pretrained(path)

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(_vocab()), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
    )
    model = BertModel(config).eval()
    if weights == "bin":  # a pickled checkpoint, as older hub models ship
        config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:
        model.save_pretrained(path)

    if sentence_transformers_files:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        flags = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "last_token": "pooling_mode_lasttoken"}
        pooling_config = {"word_embedding_dimension": 32, **{f: f == flags[pooling] for f in flags.values()}}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
        st_config = {"prompts": prompts or {}, "default_prompt_name": default_prompt_name}
        (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return path

