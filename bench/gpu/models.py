"""The model folders the benchmark runs on: the served model (a tiny random one on CPU), one of
BERT-base's size with random weights for the speed figures, and the float16 copy to carry to a
machine that cannot download the model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from bench.gpu.common import progress

# Model shapes (BertConfig fields). Random weights serve the speed figures only.
MINILM_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
BERT_BASE_SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
CPU_STANDIN_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def pick_models(scratch: Path, model: Path | None, cuda: bool) -> dict[str, tuple[Path, str, str]]:
    """The served model and the BERT-base-sized one: (folder, name, what its weights are)."""
    if model is not None:
        primary = (model, model.name, "as given (--model)")
    elif cuda:
        try:
            primary = (default_model(), "all-MiniLM-L6-v2", "pretrained")
        except Exception as err:  # no network and no cache: the shape alone still gives speed figures
            progress(f"all-MiniLM-L6-v2 unavailable ({err}); a random model of its shape stands in")
            primary = (random_model(scratch / "minilm-random", MINILM_SHAPE, _tiny(scratch / "tiny")),
                       "all-MiniLM-L6-v2-shaped", "RANDOM (a tiny vocabulary; speed and dtype paths only)")
    else:
        primary = (_tiny(scratch / "tiny"), "tiny BERT", "random (CPU mode)")
    shape, name, weights = (BERT_BASE_SHAPE, "BERT-base-sized", "RANDOM, from a config") if cuda else \
        (CPU_STANDIN_SHAPE, "small stand-in for BERT-base", "RANDOM, from a config (CPU mode)")
    second = random_model(scratch / "bert-base-random", shape, primary[0])
    return {"minilm": primary, "bert_base": (second, name, weights)}


def default_model() -> Path:
    from embedserve.archive.default_model import fetch_default_model

    return fetch_default_model()


def _tiny(path: Path) -> Path:
    from tests.support.tiny_model import make_tiny_model

    return make_tiny_model(path, max_seq_length=64)


def random_model(path: Path, shape: dict, tokenizer_from: Path, seed: int = 0) -> Path:
    """A BERT of `shape` with random weights (stored in float16), the tokenizer of another model
    folder, and sentence-transformers files for mean pooling."""
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertModel

    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    # The largest id, not the count: a vocabulary may leave ids unused.
    vocab_size = 1 + max(Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True).values())
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, max_position_embeddings=512, type_vocab_size=2, **shape)
    BertModel(config).to(torch.float16).save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": shape["hidden_size"], "pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return path


def write_fp16_copy(source: Path, target: Path) -> Path:
    """`source` with every safetensors file in float16: all-MiniLM-L6-v2 is 87 MiB in fp32, 44 in fp16."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(source, target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx", "README.md"))
    for weights in source.rglob("*.safetensors"):
        with safe_open(str(weights), "pt") as f:
            metadata = f.metadata()
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        half = {key: t.half() if t.is_floating_point() else t for key, t in tensors.items()}
        save_file(half, str(target / weights.relative_to(source)), metadata=metadata)
    return target


def describe(path: Path, name: str, weights: str) -> dict:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    parameters, dtypes = 0, set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                parameters += int(np.prod(piece.get_shape()))
                dtypes.add(piece.get_dtype())
    return {"name": name, "weights": weights, "path": str(path),
            "stored_dtype": sorted(dtypes), "parameters": parameters,
            **{key: config.get(key) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "intermediate_size", "vocab_size")}}
