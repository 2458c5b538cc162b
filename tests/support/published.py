"""Models made from their published files (tests/fixtures/published/<slug>/, each file's source in
its SOURCES.json): the config, sentence-transformers and tokenizer-config files exactly as their
authors published them, with only what no test can carry made here.

    kept as published   every key and value of config.json but the size fields below; modules.json,
                        sentence_bert_config.json, config_sentence_transformers.json, the module
                        configs (but their widths), tokenizer_config.json and special_tokens_map.json
    made smaller        hidden width, layers, heads, MLP width (SIZES): random weights of the
                        published names and vocabulary size at a width a test can run
    made here           the tokenizer's vocabulary (tokenizer.json: the published ones are 11-33 MB),
                        trained on a small corpus by the family's own tokenizer model (WordPiece,
                        Unigram, byte-level BPE), its special tokens those the published files name;
                        the published tokenizer_config.json's `added_tokens_decoder` (ids into the
                        published vocabulary) is left out, every other setting kept

Two are published in their original remote-code layout (ORIGINAL_LAYOUT: nomic-embed-text-v1.5,
gte-base-en-v1.5): their random weights are made in transformers' native port of that code and
written under the original checkpoint's names; the native folder beside them (reference_folder) is
what sentence-transformers runs as the reference, and the build must convert the first into it.

A model whose published files could not be found has only a SOURCES.json saying where they were
sought (docs/models.md says so beside its row)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from embedserve.archive.native import drop_loader_args
from tests.support import REPO
from tests.support.native_models import GTE_MLP, HEADS, HIDDEN, LAYERS, native_model, save_native, \
    save_original_weights

PUBLISHED = REPO / "tests" / "fixtures" / "published"
NOT_MODEL_FILES = {"SOURCES.json", "tokenizer_facts.json"}  # the record of the files, not files of the model

# The size fields of each model's config made small; every other published value is kept.
SIZES = {
    "labse": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32),
    "bge-m3": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32),
    "embeddinggemma-300m": dict(hidden_size=24, num_hidden_layers=6, num_attention_heads=3, num_key_value_heads=1,
                                head_dim=8, query_pre_attn_scalar=8, intermediate_size=48),
    "qwen3-embedding-0.6b": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=8, intermediate_size=64, max_window_layers=2),
    "qwen3-reranker-0.6b": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, intermediate_size=64, max_window_layers=2),
    "all-mpnet-base-v2": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "answerai-colbert-small-v1": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64),
    "bge-reranker-v2-m3": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32),
    # In the original's own names; its MLP width of 200 the original rounds up to 256 (a multiple of 256).
    "nomic-embed-text-v1.5": dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=200),
    "gte-base-en-v1.5": dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                             intermediate_size=GTE_MLP),
    "gte-multilingual-base": dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                  intermediate_size=GTE_MLP),
}
# Published in their original remote-code layout: slug -> the family of tests/support/native_models.py.
ORIGINAL_LAYOUT = {"nomic-embed-text-v1.5": "nomic", "gte-base-en-v1.5": "gte",
                   "gte-multilingual-base": "gte-multilingual"}
EMBEDDERS = ("labse", "bge-m3", "embeddinggemma-300m", "qwen3-embedding-0.6b", "all-mpnet-base-v2",
             *ORIGINAL_LAYOUT)
RERANKERS = ("bge-reranker-v2-m3",)
MULTI_VECTOR = ("answerai-colbert-small-v1",)
# Refused as published, with the reason (the build must not take them for what they are not).
REFUSED = ("qwen3-reranker-0.6b",)
# Checkpoints of a whole causal language model, its head included (Qwen3-Reranker scores with it):
# saved as transformers saves the class config.json names.
CAUSAL_LM_CHECKPOINTS = ("qwen3-reranker-0.6b",)


def published_files(slug: str) -> list[Path]:
    folder = PUBLISHED / slug
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in NOT_MODEL_FILES)


def make_published(slug: str, path: Path, *, seed: int = 0) -> Path:
    """The model `slug` at `path`: its published files, small random weights, a tokenizer made here."""
    source = PUBLISHED / slug
    path.mkdir(parents=True, exist_ok=True)
    for file in published_files(slug):
        (path / file.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, path / file.relative_to(source))
    published = json.loads((source / "config.json").read_text())
    config = {**published, **SIZES[slug]}
    if "layer_types" in config:  # per layer: the published pattern's first layers
        config["layer_types"] = config["layer_types"][:config["num_hidden_layers"]]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(slug, config, path)
    torch.manual_seed(seed)
    _module_widths(path, _width(published), _width(config))
    if slug in ORIGINAL_LAYOUT:
        _original_layout_weights(ORIGINAL_LAYOUT[slug], config, path)
    else:
        _weights(config, path, causal_lm=slug in CAUSAL_LM_CHECKPOINTS)
    return path


def reference_folder(path: Path) -> Path:
    """The folder sentence-transformers runs as the reference for the model made at `path`: the
    native port beside an original-layout model, else the model itself."""
    native = path.with_name(f"{path.name}-native")
    return native if native.is_dir() else path


def _width(config: dict) -> int:
    return config["hidden_size"] if "hidden_size" in config else config["n_embd"]  # nomic's GPT-2 style name


# --- The tokenizer -------------------------------------------------------------------------------

def _tokenizer(slug: str, config: dict, path: Path) -> None:
    """tokenizer.json of the family's kind, trained here; the published tokenizer_config.json and
    special_tokens_map.json beside it, without the ids of the published vocabulary."""
    from tests.support.model_families import _bert_tokenizer, _qwen_tokenizer, _xlmr_tokenizer

    published = json.loads((path / "tokenizer_config.json").read_text())
    made = path / "made-tokenizer"
    kind = config["model_type"]
    if kind in ("nomic_bert", "new"):  # original layouts: the tokenizer their tokenizer_config.json names
        kind = "xlm-roberta" if published.get("tokenizer_class", "").startswith("XLMRoberta") else "bert"
    facts = PUBLISHED / slug / "tokenizer_facts.json"
    if kind in ("bert", "mpnet") and facts.is_file():
        _wordpiece_as_published(json.loads(facts.read_text()), made)
    elif kind == "bert":
        _bert_tokenizer(made, 512)
    elif kind == "xlm-roberta":
        _xlmr_tokenizer(made, 512)
    elif kind == "qwen3":
        _qwen_tokenizer(made, 512)
    elif kind == "gemma3_text":
        from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

        from tests.support.model_families import corpus

        flags = {name: published[name] for name in ("add_bos_token", "add_eos_token") if name in published}
        GemmaTokenizer(**flags).train_new_from_iterator(corpus(), vocab_size=300).save_pretrained(made)
    else:
        raise ValueError(f"no tokenizer kind for model_type {kind}")
    shutil.copyfile(made / "tokenizer.json", path / "tokenizer.json")
    shutil.rmtree(made)
    published.pop("added_tokens_decoder", None)
    (path / "tokenizer_config.json").write_text(json.dumps(published, indent=2))


def _wordpiece_as_published(facts: dict, made: Path) -> None:
    """A WordPiece vocabulary trained here with the published tokenizer.json's special tokens (in
    their order), unknown token and normalizer, and its post-processor's first and last tokens."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers

    from tests.support.model_families import _save_tokenizer, _template, _wordpiece

    added = sorted(facts["added_tokens"], key=lambda token: token["id"])
    trained = _wordpiece([token["content"] for token in added], unk=facts["model"]["unk_token"])
    # The published added tokens at the head of the vocabulary, each special or not as published
    # (answerai-colbert's [unused0] / [unused1] prefixes are plain, normalized tokens).
    tokenizer = Tokenizer(models.WordPiece(trained.get_vocab(), unk_token=facts["model"]["unk_token"]))
    tokenizer.pre_tokenizer, tokenizer.decoder = trained.pre_tokenizer, trained.decoder
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=facts["normalizer"]["lowercase"])
    tokenizer.add_tokens([AddedToken(token["content"], special=token["special"], normalized=token["normalized"],
                                     lstrip=token["lstrip"], rstrip=token["rstrip"],
                                     single_word=token["single_word"]) for token in added])
    processor = facts["post_processor"]
    if processor["type"] == "TemplateProcessing":  # BERT's: [CLS] $A [SEP]
        first, last = (processor["single"][0]["SpecialToken"]["id"], processor["single"][-1]["SpecialToken"]["id"])
    else:  # RoBERTa's: cls and sep
        first, last = processor["cls"][0], processor["sep"][0]
    _template(tokenizer, first, last)
    _save_tokenizer(tokenizer, made, 512)


# --- The weights -----------------------------------------------------------------------------------

def _weights(config: dict, path: Path, causal_lm: bool = False) -> None:
    """Random weights under the names the published checkpoint has (transformers' own save of the
    architecture the config names: an encoder's names without a prefix, a classifier's or a whole
    causal language model's with it)."""
    import transformers

    architecture = config["architectures"][0]
    config_object = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "model_type"},
                                                      model_type=config["model_type"])
    if architecture.endswith("ForSequenceClassification"):
        model = transformers.AutoModelForSequenceClassification.from_config(config_object)
    elif causal_lm:
        model = transformers.AutoModelForCausalLM.from_config(config_object)
    else:  # Qwen3-Embedding says Qwen3ForCausalLM, all-mpnet-base-v2 MPNetForMaskedLM: the encoder's weights
        model = transformers.AutoModel.from_config(config_object)
    with torch.no_grad():  # livelier than the initialization, so that vectors differ clearly
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
            elif "norm" in name.lower():
                parameter.normal_(1.0 if config["model_type"] != "gemma3_text" else 0.0, 0.2)
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype:  # as published (Qwen3-Embedding's are bfloat16)
        model.to(getattr(torch, dtype))
    saved = path / "saved-weights"
    model.eval().save_pretrained(saved)
    shutil.move(str(saved / "model.safetensors"), str(path / "model.safetensors"))
    shutil.rmtree(saved)


def _original_layout_weights(family: str, config: dict, path: Path) -> None:
    """Random weights of transformers' native port, saved with its config as the reference folder
    beside `path`, and under the original checkpoint's names in `path`. The vocabulary is the
    published one (nomic's padded to its pad_vocab_size_multiple, as the original pads it)."""
    multiple = config.get("pad_vocab_size_multiple") or 1
    model = native_model(family, vocab_size=-(-config["vocab_size"] // multiple) * multiple,
                         pad_token_id=config.get("pad_token_id") or 0)
    dtype = getattr(torch, config.get("torch_dtype") or "float32")
    model.to(dtype).float()  # the published precision's values (gte-multilingual-base's are float16), in float32
    native = path.with_name(f"{path.name}-native")
    shutil.copytree(path, native)
    save_native(model, native)  # its config.json in place of the original's
    drop_loader_args(native)  # nomic's loader argument, which the native class does not take, as the build drops it
    # A checkpoint saved with a head of its own code beside the encoder (gte-multilingual-base's
    # NewForTokenClassification: the token weights' Linear(hidden, num_labels)) holds its weights too.
    head = {}
    if any(name.endswith("ForTokenClassification") for name in config["architectures"]):
        head = {"classifier.weight": torch.randn(config.get("num_labels", 1), config["hidden_size"]) * 0.2,
                "classifier.bias": torch.randn(config.get("num_labels", 1)) * 0.2}
    save_original_weights(family, {name: tensor.to(dtype) for name, tensor in model.state_dict().items()}, path,
                          head={name: tensor.to(dtype) for name, tensor in head.items()})


def _module_widths(path: Path, published_hidden: int, hidden: int) -> None:
    """The pipeline modules' configs at the small width (a Dense's other width scaled alike), with
    random weights for each Dense."""
    modules = json.loads((path / "modules.json").read_text()) if (path / "modules.json").is_file() else []
    width = {published_hidden: hidden}  # published width -> small width
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        config_file = path / module["path"] / "config.json"
        if not module["path"] or not config_file.is_file():
            continue
        config = json.loads(config_file.read_text())
        if kind == "Pooling":  # the encoder's width (gte-base-en-v1.5's is gte-large's file, 1024 wide)
            config["word_embedding_dimension"] = hidden
        elif kind == "Dense":
            for key in ("in_features", "out_features"):
                config[key] = width.setdefault(config[key], max(4, config[key] * hidden // published_hidden))
            weights = {"linear.weight": torch.randn(config["out_features"], config["in_features"]) * 0.3}
            if config.get("bias", True):
                weights["linear.bias"] = torch.randn(config["out_features"]) * 0.3
            save_file(weights, str(path / module["path"] / "model.safetensors"))
        config_file.write_text(json.dumps(config, indent=2))
