"""Copy a Hugging Face model folder into a staging folder with safetensors weights only.

What is copied: config.json, tokenizer files, the chat template and an image processor's config, sentence-transformers
description files, the weights, each pipeline module's folder (its config.json and weights: a
Dense or LayerNorm module has its own), and bge-m3's sparse and ColBERT heads. Pickled weights (`pytorch_model.bin`) are converted to safetensors with
`torch.load(weights_only=True)`, which refuses arbitrary objects; a checkpoint that needs
more than tensors is refused. Nothing pickled is ever copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path, PurePosixPath

import torch
from safetensors.torch import save_file

from embedserve.archive.native import convert_to_native
from embedserve.handler.model.files import M3_HEAD_FILES

CONFIG_FILES = ("config.json", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
    # a causal reranker's pairs are rendered by its chat template (transformers 5 saves it apart)
    "chat_template.jinja", "chat_template.json",
    # an image-text model's image processor (embedserve/handler/inputs/image.py prepares images by it)
    "preprocessor_config.json", "processor_config.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class StageError(ValueError):
    pass


def stage_model(source: Path, target: Path) -> None:
    if _is_router(source):
        _stage_inference_free(source, target)
        return
    if not (source / "config.json").is_file():
        raise StageError(f"{source} is not a Hugging Face model folder: config.json is missing")
    target.mkdir(parents=True, exist_ok=True)
    for name in CONFIG_FILES + TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    for folder in _module_folders(source):
        if (source / folder / "config.json").is_file():
            (target / folder).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / folder / "config.json", target / folder / "config.json")
            _stage_weights(source / folder, target / folder, required=False)
    _stage_weights(source, target)
    for head in M3_HEAD_FILES:  # bge-m3's heads: pickled state dicts, converted as the weights are
        if (source / f"{head}.safetensors").is_file():
            shutil.copyfile(source / f"{head}.safetensors", target / f"{head}.safetensors")
        elif (source / f"{head}.pt").is_file():
            _convert_pickled_weights(source / f"{head}.pt", target / f"{head}.safetensors")
    if not (target / "tokenizer.json").is_file():
        _convert_tokenizer(source, target)
    convert_to_native(target)  # an original remote-code layout (nomic-bert, GTE "new") -> the native class's


def _is_router(source: Path) -> bool:
    modules_file = source / "modules.json"
    if not modules_file.is_file() or not (source / "router_config.json").is_file():
        return False
    modules = json.loads(modules_file.read_text())
    return len(modules) == 1 and str(modules[0].get("type", "")).endswith(".Router")


def _stage_inference_free(source: Path, target: Path) -> None:
    """An inference-free sparse encoder (sentence-transformers' Router: a SparseStaticEmbedding
    for queries, a SPLADE model for documents), staged as the SPLADE model it is for documents,
    with the query side's weights and tokenizer in `query_static/` (model/files.py reads it)."""
    router = json.loads((source / "router_config.json").read_text())
    types = {name: str(kind).rsplit(".", 1)[-1] for name, kind in router.get("types", {}).items()}
    structure = router.get("structure", {})
    query, document = structure.get("query", []), structure.get("document", [])
    parameters = router.get("parameters", {})
    shape = ([types.get(m) for m in query], [types.get(m) for m in document])
    if shape not in ((["SparseStaticEmbedding"], ["Transformer", "SpladePooling"]),
                     (["SparseStaticEmbedding"], ["MLMTransformer", "SpladePooling"])) \
            or set(structure) != {"query", "document"} or parameters.get("route_mappings") \
            or parameters.get("default_route") not in (None, "document"):
        raise StageError(f"{source}/router_config.json: a Router of {structure} ({types}); supported: a "
                         "SparseStaticEmbedding query side and a fill-mask Transformer with SpladePooling document side, "
                         "documents by default (an inference-free SPLADE model)")
    transformer, pooling = (source / safe_relative(name, "router module") for name in document)
    stage_model(transformer, target)  # the document side's transformer, as the model itself
    (target / "1_SpladePooling").mkdir(exist_ok=True)
    shutil.copyfile(pooling / "config.json", target / "1_SpladePooling" / "config.json")
    (target / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"}], indent=2))
    if (source / "config_sentence_transformers.json").is_file():
        shutil.copyfile(source / "config_sentence_transformers.json", target / "config_sentence_transformers.json")
    static = source / safe_relative(query[0], "router module")
    (target / "query_static").mkdir(exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (static / name).is_file():
            shutil.copyfile(static / name, target / "query_static" / name)
    _stage_weights(static, target / "query_static")


def safe_relative(name: str, what: str) -> PurePosixPath:
    """A relative path that stays inside its folder, or StageError."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name:
        raise StageError(f"{what} '{name}' escapes the model folder; refusing to archive it")
    return path


def _module_folders(source: Path) -> list[str]:
    modules_file = source / "modules.json"
    if not modules_file.is_file():
        return []
    folders = [m.get("path", "") for m in json.loads(modules_file.read_text())]
    return [str(safe_relative(f, "modules.json path")) for f in folders if f]


def _stage_weights(source: Path, target: Path, required: bool = True) -> None:
    index = source / "model.safetensors.index.json"
    if (source / "model.safetensors").is_file():
        shutil.copyfile(source / "model.safetensors", target / "model.safetensors")
    elif index.is_file():
        shutil.copyfile(index, target / index.name)
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            shutil.copyfile(source / safe_relative(shard, "weight shard"), target / shard)
    elif (source / "pytorch_model.bin").is_file():
        _convert_pickled_weights(source / "pytorch_model.bin", target / "model.safetensors")
    elif required:
        raise StageError(f"{source} has no weights: expected model.safetensors or pytorch_model.bin")


def _convert_pickled_weights(checkpoint: Path, output: Path) -> None:
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses anything but tensors and plain containers
        raise StageError(f"cannot convert {checkpoint.name} safely (it holds more than tensors): {err}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise StageError(f"{checkpoint.name} is not a flat state dict of tensors; refusing to convert it")
    # safetensors refuses tensors that share memory (tied weights): give each its own copy.
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(output), metadata={"format": "pt"})


def _convert_tokenizer(source: Path, target: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, use_fast=True)
    if not tokenizer.is_fast:
        raise StageError(f"{source} has no fast tokenizer and none could be converted")
    tokenizer.save_pretrained(target)
