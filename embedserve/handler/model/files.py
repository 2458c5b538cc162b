"""What a model folder says about itself: its architecture and its sentence-transformers pipeline.

sentence-transformers describes a model as a pipeline in `modules.json`: a Transformer (the
Hugging Face model, configured by `sentence_bert_config.json`), a Pooling module (its folder's
`config.json`), then modules that transform the pooled vector (Dense, LayerNorm, Normalize).
`config_sentence_transformers.json` holds named prompts ("query: ", ...) and the default one.

A scoring model (a reranker or a classifier) is a Hugging Face sequence-classification model: its
own head gives one logit per label for a text or a (query, document) pair. sentence-transformers 6
saves a `CrossEncoder` as such a model with a lone Transformer module, its activation in
`config_sentence_transformers.json` (Sigmoid for one label, the identity for several, by default).
A causal language model reranker (the Qwen3-Reranker shape) is a Transformer module followed by
`LogitScore`: each (query, document) pair is rendered through the model's chat template (roles
"query" and "document", an instruction as a "system" message), and the score is the last
token's logit of the "yes" token less that of the "no" token (model/chat_pairs.py renders the
pairs, model/head.py builds that one-row head over last-token pooling).

Every module that changes the vectors is either read here, to be applied exactly as
sentence-transformers applies it, or refused with an error naming it: a model is never served
with a step of its pipeline silently skipped. Module types are matched by class name, so the
names of every sentence-transformers release match (`sentence_transformers.models.Pooling`,
`sentence_transformers.sentence_transformer.modules.pooling.Pooling`, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embedserve.handler.model.description import (HEAD_MODULES, IDENTITY_MODULES, POOLING_FLAGS, POOLING_MODES,
                                                  SPARSE_ACTIVATIONS, SPARSE_STRATEGIES, ChatFormat, HeadModule,
                                                  LogitScore, M3Heads, ModelDescription, ModelFilesError, MultiVector,
                                                  Pooling, QueryExpansion, Scoring, SparsePooling, TokenPooling)
from embedserve.handler.model.head import activation_class, check_head_module
from embedserve.handler.model.pylate import is_pylate, prefixed_prompts, read_pylate
from embedserve.handler.model.pages import read_pages
from embedserve.handler.model.towers import read_towers

# How a causal language model's checkpoint names its architecture (config.json's `architectures`).
DECODER_HEADS = ("ForCausalLM", "LMHeadModel")

_MODE_ALIASES = {"lasttoken": "last_token", "mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}

# Architectures whose position ids start after the padding id (fairseq's convention), so the
# table's first pad_token_id + 1 rows are never used for a real token: XLM-R's 514 rows hold 512
# positions. A longer input indexes past the table (IndexError on a CPU, a device-side assert on
# a GPU).
PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "data2vec-text",
                            "roberta-prelayernorm", "xmod", "ibert", "longformer")


def describe_model(model_dir: str | Path) -> ModelDescription:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelFilesError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    config = _read_json(model_dir / "config.json")
    check_architecture(config)
    if "vlm_config" in config:  # ColPali: a vision-language model under a retrieval head
        return _describe_pages(model_dir, config)
    if "vision_config" in config:  # CLIP, SigLIP: a vision tower beside the text model
        return _describe_towers(model_dir, config)
    if not isinstance(config.get("hidden_size"), int):
        raise ModelFilesError(f"{model_dir / 'config.json'} has no integer hidden_size")
    scoring = _read_scoring(model_dir, config)
    sparse = None if scoring else _read_sparse(model_dir, config)
    multi_vector, token_head = (None, ()) if scoring or sparse else _read_multi_vector(model_dir)
    pooling, head = (None, token_head) if scoring or sparse or multi_vector else _read_pipeline(model_dir)
    m3 = None if scoring or sparse or multi_vector else _read_m3(model_dir)
    if scoring and scoring.logit_score:  # the score is read at the last token
        pooling = Pooling(("last_token",))
    architecture = str((config.get("architectures") or [""])[0])
    unpooled_decoder = architecture if pooling is None and not (scoring or sparse or multi_vector or m3) and \
        architecture.endswith(DECODER_HEADS) else None
    transformer = _transformer_config(model_dir)
    prompts, default_prompt_name = _read_prompts(model_dir)
    if multi_vector and multi_vector.prefixes:
        prompts = prefixed_prompts(prompts, multi_vector.prefixes)
    return ModelDescription(
        model_type=str(config.get("model_type", "")),
        hidden_size=config["hidden_size"],
        pooling=pooling,
        max_seq_length=_max_seq_length(transformer),
        usable_positions=usable_positions(config),
        head=head,
        do_lower_case=bool(transformer.get("do_lower_case", False)),
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        scoring=scoring,
        sparse=sparse,
        m3=m3,
        multi_vector=multi_vector,
        unpooled_decoder=unpooled_decoder,
    )


def _describe_towers(model_dir: Path, config: dict[str, Any]) -> ModelDescription:
    """An image-text dual encoder (model/towers.py): texts through its text tower, images through
    its vision tower, each pooled its own way."""
    towers = read_towers(model_dir, config)
    transformer = _transformer_config(model_dir)
    prompts, default_prompt_name = _read_prompts(model_dir)
    return ModelDescription(
        model_type=str(config.get("model_type", "")), hidden_size=towers.dimension, pooling=None,
        max_seq_length=_max_seq_length(transformer),
        usable_positions=towers.text_positions, prompts=prompts, default_prompt_name=default_prompt_name,
        towers=towers)


def _describe_pages(model_dir: Path, config: dict[str, Any]) -> ModelDescription:
    """A page retriever (model/pages.py): a vector per position of a page image or a query,
    scored by MaxSim as a multi-vector model's tokens are."""
    pages = read_pages(model_dir, config)
    return ModelDescription(
        model_type=str(config.get("model_type", "")), hidden_size=pages.dimension, pooling=None, max_seq_length=None,
        usable_positions=pages.text_positions, pages=pages,
        multi_vector=MultiVector(query_length=None, document_length=None, expansion=None, skiplist_words=(),
                                 skiplist_tasks=(), similarity="maxsim"))


def _transformer_config(model_dir: Path) -> dict[str, Any]:
    """The Transformer module's sentence_bert_config.json; empty where the folder has none."""
    path = model_dir / "sentence_bert_config.json"
    return _read_json(path) if path.is_file() else {}


def _max_seq_length(transformer: dict[str, Any]) -> int | None:
    return int(transformer["max_seq_length"]) if transformer.get("max_seq_length") else None


def check_architecture(config: dict[str, Any]) -> None:
    """Refuse what AutoModel cannot run as a plain encoder from the model's own weights."""
    model_type = config.get("model_type", "?")
    if config.get("is_encoder_decoder"):
        raise ModelFilesError(f"'{model_type}' is an encoder-decoder model (T5-style); only encoder and "
                              "decoder-only embedding models are supported")
    from transformers import CONFIG_MAPPING

    if any(key.startswith(("AutoModel", "AutoConfig")) for key in config.get("auto_map") or {}):
        raise ModelFilesError(f"model_type '{model_type}' ships its own code (auto_map), which this server never "
                              "runs; ./build_mar.sh rewrites the original nomic-bert and GTE layouts for transformers' "
                              "native classes and refuses others; see the supported families in docs/models.md")
    if model_type not in CONFIG_MAPPING:
        raise ModelFilesError(f"model_type '{model_type}' is not an architecture of the installed transformers; "
                              "see the supported families in docs/models.md")


def usable_positions(config: dict[str, Any]) -> int | None:
    """Tokens per input the position embeddings allow; None for models without a position limit."""
    table = config.get("max_position_embeddings")
    if not isinstance(table, int) or table <= 0:
        return None
    if config.get("model_type") in PADDING_OFFSET_POSITIONS:
        return table - int(config.get("pad_token_id") if config.get("pad_token_id") is not None else 1) - 1
    return table


def _read_scoring(model_dir: Path, config: dict[str, Any]) -> Scoring | None:
    """The head of a scoring model (a CrossEncoder, a plain Hugging Face classifier, or a causal
    language model reranker); None for an embedding model."""
    architecture = str((config.get("architectures") or [""])[0])
    modules = _read_json(model_dir / "modules.json") if (model_dir / "modules.json").is_file() else []
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    st_config = _read_json(model_dir / "config_sentence_transformers.json") if (
        model_dir / "config_sentence_transformers.json").is_file() else {}
    causal_cross_encoder = architecture.endswith("ForCausalLM") and st_config.get("model_type") == "CrossEncoder"
    if "LogitScore" in kinds or causal_cross_encoder:
        return _read_causal_reranker(model_dir, config, modules, kinds, st_config)
    if not architecture.endswith("ForSequenceClassification"):
        return None
    if kinds not in ([], ["Transformer"]):
        raise ModelFilesError(f"{model_dir}/modules.json: a sequence-classification model with modules "
                              f"{kinds}; only a CrossEncoder's lone Transformer is supported")
    labels = config.get("id2label") or {}
    count = int(config.get("num_labels") or len(labels) or 1)
    names = tuple(str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(count))
    if st_config.get("default_prompt_name"):
        raise ModelFilesError(f"{model_dir}/config_sentence_transformers.json: a default prompt for a cross-encoder "
                              "is not supported")
    activation = _activation(model_dir, config, st_config, count)
    return Scoring(names, activation, segments=int(config.get("type_vocab_size") or 0) > 1)


def _activation(model_dir: Path, config: dict[str, Any], st_config: dict[str, Any], labels: int) -> str:
    """The activation CrossEncoder.predict applies, by class name. sentence-transformers' order:
    its own config, then the model config's (v4+), then the default."""
    activation = st_config.get("activation_fn") or (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function") \
        or ("torch.nn.modules.activation.Sigmoid" if labels == 1 else "torch.nn.modules.linear.Identity")
    activation_class(activation, f"{model_dir}: activation_fn")
    return activation.rsplit(".", 1)[-1]


def _read_causal_reranker(model_dir: Path, config: dict[str, Any], modules: list[dict[str, Any]], kinds: list[str],
                          st_config: dict[str, Any]) -> Scoring:
    """A CrossEncoder over a causal language model, as sentence-transformers 6 saves it: a
    Transformer (text generation, pairs rendered as chat messages) and a LogitScore module."""
    architecture = str((config.get("architectures") or ["?"])[0])
    if kinds != ["Transformer", "LogitScore"]:
        raise ModelFilesError(f"{model_dir}/modules.json: a causal language model reranker ({architecture}) with "
                              f"modules {kinds}; supported: Transformer then LogitScore, as sentence-transformers 6 "
                              "saves a CrossEncoder")
    if not architecture.endswith("ForCausalLM"):
        raise ModelFilesError(f"{model_dir}: LogitScore reads a causal language model's logits; this model is "
                              f"{architecture}")
    folder = str(sorted(modules, key=lambda m: int(m.get("idx", 0)))[1].get("path") or "")
    score_config = _read_json(model_dir / folder / "config.json")
    true_id, false_id = score_config.get("true_token_id"), score_config.get("false_token_id")
    vocab = int(config.get("vocab_size") or 0)
    for key, value in (("true_token_id", true_id), ("false_token_id", false_id)):
        if not (value is None and key == "false_token_id") and not (isinstance(value, int) and 0 <= value < vocab):
            raise ModelFilesError(f"{model_dir / folder / 'config.json'}: '{key}' must be a token id below the "
                                  f"vocabulary's {vocab}, got {value!r}")
    if score_config.get("module_input_name", "causal_logits") != "causal_logits":
        raise ModelFilesError(f"{model_dir / folder / 'config.json'}: LogitScore reading "
                              f"'{score_config['module_input_name']}' is not supported (only causal_logits)")
    activation = _activation(model_dir, config, st_config, 1)
    return Scoring(("LABEL_0",), activation, segments=False, logit_score=LogitScore(true_id, false_id),
                   chat=_read_chat_format(model_dir))


# bge-m3's heads beside the encoder, as the build stages them (model/m3.py loads them).
M3_HEAD_FILES = ("sparse_linear", "colbert_linear")


def _read_m3(model_dir: Path) -> M3Heads | None:
    """bge-m3's sparse and ColBERT heads, where the folder has both; None otherwise. Its own files
    are pickled state dicts (`.pt`): the build converts them, so a folder with only those is refused."""
    present = [name for name in M3_HEAD_FILES if (model_dir / f"{name}.safetensors").is_file()]
    pickled = [name for name in M3_HEAD_FILES if (model_dir / f"{name}.pt").is_file()]
    if not present and not pickled:
        return None
    if len(present) != len(M3_HEAD_FILES):
        raise ModelFilesError(f"{model_dir}: bge-m3's heads {', '.join(f'{n}.pt' for n in pickled) or present} are "
                              "not both in safetensors; build the folder with build_mar.sh, which converts them with "
                              "torch.load(weights_only=True)")
    from safetensors import safe_open

    with safe_open(str(model_dir / "colbert_linear.safetensors"), "pt") as weights:
        shape = weights.get_slice("weight").get_shape()
    return M3Heads(colbert_dimension=int(shape[0]))


def _read_multi_vector(model_dir: Path) -> tuple[MultiVector | None, tuple[HeadModule, ...]]:
    """A sentence-transformers 6 MultiVectorEncoder's token pipeline (Transformer, Dense modules,
    MultiVectorMask, Normalize), or PyLate's ColBERT layout as sentence-transformers reads it
    (model/pylate.py), and its Dense and Normalize modules; (None, ()) for another model."""
    modules_file = model_dir / "modules.json"
    st_config = _read_json(model_dir / "config_sentence_transformers.json") if (
        model_dir / "config_sentence_transformers.json").is_file() else {}
    modules = sorted(_read_json(modules_file), key=lambda m: int(m.get("idx", 0))) if modules_file.is_file() else []
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    if modules and is_pylate(modules, st_config):
        if modules[0].get("path"):
            raise ModelFilesError(f"{modules_file}: the Transformer module is in a subfolder; not supported")
        denses = [(str(m.get("path") or ""), _read_json(model_dir / str(m.get("path") or "") / "config.json"))
                  for m in modules[1:] if str(m.get("type", "")).rsplit(".", 1)[-1] == "Dense"]
        transformer = _transformer_config(model_dir)
        return read_pylate(modules_file, kinds, denses, st_config, transformer)
    if st_config.get("model_type") != "MultiVectorEncoder" and "MultiVectorMask" not in kinds:
        return None, ()
    denses = kinds[1:kinds.index("MultiVectorMask")] if "MultiVectorMask" in kinds else []
    pooled = kinds[-1:] == ["HierarchicalTokenPooling"]
    if kinds[:1] != ["Transformer"] or modules[0].get("path") or set(denses) - {"Dense"} \
            or kinds[1 + len(denses):len(kinds) - pooled] != ["MultiVectorMask", "Normalize"]:
        raise ModelFilesError(f"{modules_file}: a multi-vector encoder with modules {kinds}; supported: Transformer, "
                              "Dense modules, MultiVectorMask, Normalize, and a HierarchicalTokenPooling")
    head = []
    for position, module in enumerate(modules[1:1 + len(denses)], start=1):
        folder = str(module.get("path") or "")
        config = _read_json(model_dir / folder / "config.json")
        head.append(check_head_module(HeadModule("Dense", folder, config), f"modules.json module {position}",
                                      feature="token_embeddings"))
    mask_folder = model_dir / str(modules[1 + len(denses)].get("path") or "")
    mask = _read_json(mask_folder / "config.json") if (mask_folder / "config.json").is_file() else {}
    if mask.get("keep_only_token_ids"):
        raise ModelFilesError(f"{mask_folder}: keep_only_token_ids (image patches) is not served")
    transformer = _transformer_config(model_dir)
    expansion = transformer.get("query_expansion")
    if expansion is not None and (not isinstance(expansion, dict) or expansion.get("strategy") not in ("fixed", "min")
                                  or not isinstance(expansion.get("length"), int)):
        raise ModelFilesError(f"{model_dir / 'sentence_bert_config.json'}: query_expansion {expansion!r} is not "
                              "{strategy: fixed|min, length, attend, token}")
    similarity = st_config.get("similarity_fn_name") or "maxsim"
    if similarity not in ("maxsim", "meanmaxsim"):
        raise ModelFilesError(f"{model_dir}: similarity_fn_name {similarity!r}; supported: maxsim, meanmaxsim")
    token_pooling = None
    if pooled:
        folder = model_dir / str(modules[-1].get("path") or "")
        config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        # sentence-transformers' loading defaults: a saved config without normalize_embeddings does not normalize.
        token_pooling = TokenPooling(float(config.get("pool_factor", 2.0)), int(config.get("num_protected_tokens", 1)),
                                     bool(config.get("normalize_embeddings", False)),
                                     tuple(config.get("tasks") or ("document",)))
    return MultiVector(
        query_length=transformer.get("query_length"), document_length=transformer.get("document_length"),
        expansion=QueryExpansion(expansion["strategy"], expansion["length"], bool(expansion.get("attend", False)),
                                 expansion.get("token")) if expansion else None,
        skiplist_words=tuple(mask.get("skiplist_words") or ()),
        skiplist_tasks=tuple(mask.get("skiplist_tasks") or ("document",)), similarity=similarity,
        token_pooling=token_pooling), (*head, HeadModule("Normalize", str(modules[1 + len(denses) + 1].get("path") or "")))


# The modules of sentence-transformers' SparseEncoder pipelines.
_SPARSE_MODULES = ("MLMTransformer", "SpladePooling", "SparseStaticEmbedding", "Router", "SparseAutoEncoder")


def _read_sparse(model_dir: Path, config: dict[str, Any]) -> SparsePooling | None:
    """A SPLADE model's pooling (a SparseEncoder of a masked-language model and SpladePooling),
    or None for a dense model. Other sparse pipelines are refused by name."""
    modules_file = model_dir / "modules.json"
    modules = sorted(_read_json(modules_file), key=lambda m: int(m.get("idx", 0))) if modules_file.is_file() else []
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    if not set(kinds) & set(_SPARSE_MODULES):
        return None
    transformer = _transformer_config(model_dir)
    masked_lm = kinds[:1] == ["MLMTransformer"] or (kinds[:1] == ["Transformer"] and not modules[0].get("path")
                                                    and transformer.get("transformer_task") == "fill-mask")
    if not masked_lm or kinds[1:] != ["SpladePooling"]:
        raise ModelFilesError(f"{modules_file}: a sparse encoder with modules {kinds}; supported: a masked-language "
                              "model Transformer (fill-mask) then SpladePooling (SPLADE)")
    architecture = str((config.get("architectures") or ["?"])[0])
    if not architecture.endswith("ForMaskedLM"):
        raise ModelFilesError(f"{model_dir}: SpladePooling reads a masked-language model's logits; this model is "
                              f"{architecture}")
    folder = model_dir / str(modules[1].get("path") or "")
    pooling = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    strategy = pooling.get("pooling_strategy", "max")
    activation = pooling.get("activation_function", "relu")
    if strategy not in SPARSE_STRATEGIES or activation not in SPARSE_ACTIVATIONS:
        raise ModelFilesError(f"{folder / 'config.json'}: pooling_strategy {strategy!r} and activation_function "
                              f"{activation!r}; supported: {', '.join(SPARSE_STRATEGIES)} and "
                              f"{', '.join(SPARSE_ACTIVATIONS)}")
    if not isinstance(config.get("vocab_size"), int):
        raise ModelFilesError(f"{model_dir / 'config.json'} has no integer vocab_size")
    static = model_dir / "query_static"  # an inference-free model's query side (archive/stage.py)
    if static.is_dir() and (static / "tokenizer.json").read_bytes() != (model_dir / "tokenizer.json").read_bytes():
        raise ModelFilesError(f"{static}: the query side's tokenizer differs from the document side's; not served")
    return SparsePooling(strategy, activation, config["vocab_size"], static_query=static.is_dir())


# What sentence-transformers 6 does with a Transformer's processing_kwargs that this server
# reproduces: the chat template's own keyword arguments, and its restore_suffix flag.
_CHAT_KEYS = ("chat_template",)


def _read_chat_format(model_dir: Path) -> ChatFormat:
    """How the Transformer module renders pairs (sentence_bert_config.json): as chat messages,
    in the format it saved, with the template arguments it saved. Pairs tokenized without a chat
    template are refused: that path is not reproduced."""
    path = model_dir / "sentence_bert_config.json"
    transformer = _read_json(path) if path.is_file() else {}
    modality = transformer.get("modality_config") or {}
    message = modality.get("message")
    if not isinstance(message, dict):
        raise ModelFilesError(f"{path}: this causal reranker's Transformer takes no chat messages (no 'message' in "
                              "modality_config), so its pairs are not rendered by a chat template; only chat-template "
                              "rerankers are supported")
    message_format = message.get("format", "structured")
    if message_format not in ("flat", "structured"):
        raise ModelFilesError(f"{path}: message format '{message_format}' is not 'flat' or 'structured'")
    processing = transformer.get("processing_kwargs") or {}
    unknown = sorted(set(processing) - set(_CHAT_KEYS))
    if unknown:
        raise ModelFilesError(f"{path}: processing_kwargs {unknown} change how pairs are tokenized; only "
                              f"{', '.join(_CHAT_KEYS)} is supported")
    template_kwargs = dict(processing.get("chat_template") or {})
    restore_suffix = bool(template_kwargs.pop("restore_suffix", True))
    sizes = sorted({"padding", "truncation", "max_length", "return_tensors", "tokenize"} & set(template_kwargs))
    if sizes:
        raise ModelFilesError(f"{path}: processing_kwargs.chat_template sets {sizes}; not supported")
    return ChatFormat(message_format, tuple(sorted(template_kwargs.items())), restore_suffix)


def _read_pipeline(model_dir: Path) -> tuple[Pooling | None, tuple[HeadModule, ...]]:
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, ()
    modules = sorted(_read_json(modules_file), key=lambda m: int(m.get("idx", 0)))
    pooling: Pooling | None = None
    head: list[HeadModule] = []
    for position, module in enumerate(modules):
        kind, folder = _class_name(module), str(module.get("path") or "")
        where = f"modules.json module {position} ({module.get('type')}, folder '{folder}')"
        if kind == "Transformer":
            if position != 0 or folder:
                raise ModelFilesError(f"{where}: the Transformer must be the first module and live in the model "
                                      "folder itself")
        elif kind == "Pooling":
            if pooling is not None or head:
                raise ModelFilesError(f"{where}: a second Pooling, or Pooling after {', '.join(HEAD_MODULES)}, "
                                      "is not supported")
            pooling = _read_pooling(model_dir / folder)
        elif kind in HEAD_MODULES:
            if pooling is None:
                raise ModelFilesError(f"{where}: {kind} before Pooling works on token embeddings; not supported")
            config = _read_json(model_dir / folder / "config.json") if (model_dir / folder / "config.json").is_file() \
                else {}
            head.append(check_head_module(HeadModule(kind, folder, config), where))
        elif kind not in IDENTITY_MODULES:
            raise ModelFilesError(f"{where}: this module type changes the vectors and is not supported; refusing "
                                  "to serve the model without it (supported: Transformer, Pooling, "
                                  f"{', '.join(HEAD_MODULES)}, Dropout)")
    if pooling is None:
        raise ModelFilesError("modules.json has no Pooling module: sentence-transformers gives no sentence "
                              "embedding for this pipeline")
    return pooling, tuple(head)


def _class_name(module: dict[str, Any]) -> str:
    kind = str(module.get("type", ""))
    if not kind.startswith("sentence_transformers."):
        raise ModelFilesError(f"modules.json module type '{kind}' is custom code, which this server never runs")
    return kind.rsplit(".", 1)[-1]


def _read_pooling(folder: Path) -> Pooling:
    """sentence-transformers' rules: `pooling_mode` (a name or a list) wins; else the legacy
    flags, concatenated in their fixed order; no mode at all means mean."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelFilesError(f"modules.json names a Pooling module but {config_file} is missing")
    config = _read_json(config_file)
    declared = config.get("pooling_mode")
    if declared is not None:
        names = [declared] if isinstance(declared, str) else list(declared)
        modes = tuple(_MODE_ALIASES.get(name, name) for name in names)
    else:
        modes = tuple(mode for flag, mode in POOLING_FLAGS.items() if config.get(flag)) or ("mean",)
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if unknown or not modes:
        raise ModelFilesError(f"{config_file}: pooling mode {unknown or declared!r} is not one of "
                              f"{', '.join(POOLING_MODES)}")
    return Pooling(modes, include_prompt=bool(config.get("include_prompt", True)))


def _read_prompts(model_dir: Path) -> tuple[dict[str, str], str | None]:
    config_file = model_dir / "config_sentence_transformers.json"
    if not config_file.is_file():
        return {}, None
    config = _read_json(config_file)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelFilesError(f"{config_file}: 'prompts' must map names to strings")
    default = config.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise ModelFilesError(f"{config_file}: default_prompt_name '{default}' is not among the prompts")
    return dict(prompts), default


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelFilesError(f"cannot read {path}: {err}") from None


def resolve_max_length(setting: int, st_max_seq_length: int | None, tokenizer_limit: int | None,
                       max_positions: int | None) -> int:
    """The token limit per input: the setting, else sentence-transformers' max_seq_length (which
    it applies over the tokenizer's own limit), else the tokenizer's; never beyond the positions
    the architecture can use (XLM-R: 512 of its 514 position embeddings)."""
    positions = max_positions or 10**9
    if setting:
        if setting > positions:
            raise ValueError(f"handler setting 'max_length': {setting} exceeds the {positions} positions this "
                             "model can use")
        return setting
    if not tokenizer_limit or tokenizer_limit > 10**6:  # transformers' "no limit" sentinel
        tokenizer_limit = positions
    return min(st_max_seq_length or tokenizer_limit, positions)
