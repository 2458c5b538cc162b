"""A staged folder in an original remote-code layout, rewritten in transformers' native layout.

Some models ship their own modeling code (`auto_map` in config.json) for an architecture that
transformers 5 now has natively. This server never runs a folder's code, so at build time such a
folder is rewritten for the native class:

    nomic-bert (nomic-embed-text-v1.5)   model_type nomic_bert, GPT-2 style names  -> NomicBertModel
    GTE "new" (gte-*-v1.5), Arctic-m-v2  model_type new (or gte with auto_map)      -> GteModel

The config is mapped field by field to the native config class, keeping every value that changes
the computation; a value the native class cannot reproduce exactly (another norm, interleaved or
partial rotary, biases the native layers lack, ...) refuses the build with the reason. The weights
are renamed as transformers' own conversion_mapping.py renames them on load (fused q/k/v split,
the GTE `up_gate_proj` split), then checked strictly against the native model's names and shapes:
a missing or unexpected weight refuses the build, naming it. `auto_map` is dropped, and the staged
config records what it was converted from (NATIVE_FIELD). Only the `auto_map` entry of the class
the served pipeline runs decides (the encoder, `AutoModel`); the other heads a published folder
lists (masked LM, classification, QA, ...) are never run; a checkpoint saved with such a head
beside the encoder (gte-multilingual-base: `architectures` NewModel and NewForTokenClassification)
is converted without the head's weights, and the build says which. A folder whose deciding entry names code
with no native port here is refused, naming the entry; so is jina-embeddings-v3 (XLMRobertaLoRA),
whose native port lacks what its code computes (_NO_EXACT_PORT says what).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

NATIVE_FIELD = "embedserve_native"  # in the staged config.json: {"class": ..., "converted_from": ...}


class NativeLayoutError(ValueError):
    pass


def convert_to_native(folder: Path) -> str | None:
    """Rewrite the staged `folder` in place when its config is an original layout with a native
    port; return what was done (None when there was nothing to do)."""
    config = json.loads((folder / "config.json").read_text())
    family = _family(config)
    if family is None:
        return None
    native_class, mapper, renamer = _FAMILIES[family]
    native = mapper(config)
    origin = str((config.get("auto_map") or {}).get("AutoModel") or config.get("model_type"))
    weights, dropped = _encoder_weights(config, family, _read_weights(folder))
    renamed = _rename_all(weights, renamer)
    config_object = _check_weights(native, native_class, renamed)
    for stale in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in renamed.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    staged = config_object.to_dict()
    staged["architectures"] = [native_class]
    staged[NATIVE_FIELD] = {"class": native_class, "converted_from": origin}
    if dropped:
        staged[NATIVE_FIELD]["heads_dropped"] = dropped
    (folder / "config.json").write_text(json.dumps(staged, indent=2))
    drop_loader_args(folder)
    return native_note(folder)


# Arguments published for the original code's own loader in sentence_bert_config.json's
# `model_args`: nomic-embed-text-v1.5's `safe_serialization` (its from_pretrained reads
# model.safetensors when true). transformers passes them on to the native class, which takes no
# such argument, so sentence-transformers could not load the converted folder; the staged folder
# is safetensors whatever they said.
_ORIGINAL_LOADER_ARGS = ("safe_serialization",)


def drop_loader_args(folder: Path) -> None:
    """Drop the original loader's own arguments from the folder's sentence_bert_config.json."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return
    settings = json.loads(path.read_text())
    model_args = settings.get("model_args")
    if not isinstance(model_args, dict) or not any(name in model_args for name in _ORIGINAL_LOADER_ARGS):
        return
    settings["model_args"] = {k: v for k, v in model_args.items() if k not in _ORIGINAL_LOADER_ARGS}
    path.write_text(json.dumps(settings, indent=2))


def native_note(folder: Path) -> str | None:
    """The build's line for a converted folder, from its staged config; None for any other."""
    config = json.loads((folder / "config.json").read_text())
    native = config.get(NATIVE_FIELD)
    if not native:
        return None
    dropped = native.get("heads_dropped") or []
    return (f"served by transformers' native {native['class']} (model_type {config['model_type']}): converted at "
            f"build from the original layout of {native['converted_from']}, whose code is never run"
            + (f"; the weights of the other heads saved beside the encoder ({_names(dropped)}) are never run and "
               "were left out" if dropped else ""))


# The prefix under which a head's checkpoint keeps its encoder (GTE's NewFor... heads: `self.new`).
_ENCODER_PREFIX = {"gte": "new."}


def _encoder_weights(config: dict[str, Any], family: str, weights: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The encoder's weights, and the names of those left out: a checkpoint saved with a head of
    its own code beside the encoder (gte-multilingual-base: NewModel and NewForTokenClassification,
    its token weights' `classifier`) holds the encoder under its prefix and the head's weights
    outside it. Only where `architectures` names such a head; any other stray weight still refuses."""
    architectures = set(config.get("architectures") or []) - set(_KNOWN_CODE[family])
    prefix = _ENCODER_PREFIX.get(family)
    if not architectures or not prefix or not any(name.startswith(prefix) for name in weights):
        return weights, []
    dropped = sorted(name for name in weights if not name.startswith(prefix))
    return {name: tensor for name, tensor in weights.items() if name.startswith(prefix)}, dropped


# --- Which layout a config is in -------------------------------------------------------------

# The classes each family's own code names in `auto_map` for its encoder.
_KNOWN_CODE = {"nomic": ("NomicBertModel",), "gte": ("NewModel", "GteModel")}
# Code transformers ports natively but not exactly: the reason the build gives instead of converting.
_NO_EXACT_PORT = {
    "XLMRobertaLoRA": (
        "transformers' native JinaEmbeddingsV3Model ports its encoder (rotary XLM-RoBERTa, fused mixer.Wqkv) but "
        "not its LoRA task adapters: it has no adapter weights and no way to select one, so the vectors its 'task' "
        "selects (retrieval.query, retrieval.passage, separation, classification, text-matching) cannot be "
        "computed; converting would serve the adapter-free base model under the adapters' prompts"),
}
_NOMIC_NAMES = ("n_embd", "n_layer", "n_head", "n_inner", "rotary_emb_base", "activation_function")


def _family(config: dict[str, Any]) -> str | None:
    model_type = config.get("model_type")
    auto_map = config.get("auto_map") or {}
    if model_type == "nomic_bert" and (auto_map or any(name in config for name in _NOMIC_NAMES)):
        family = "nomic"
    elif model_type == "new" or (model_type == "gte" and auto_map):
        family = "gte"
    else:
        family = None
    served = _served_code(config, auto_map)
    if served and (family is None or served[1].rsplit(".", 1)[-1] not in _KNOWN_CODE[family]):
        key, value = served
        reason = _NO_EXACT_PORT.get(value.rsplit(".", 1)[-1])
        if reason:
            raise NativeLayoutError(f"config.json: auto_map {key} is '{value}', the model's own code, which this "
                                    f"server never runs, and transformers has no native port of all it computes: "
                                    f"{reason}; see docs/models.md")
        ported = "; ".join(f"{', '.join(classes)} ({name})" for name, classes in _KNOWN_CODE.items())
        raise NativeLayoutError(
            f"config.json: auto_map {key} is '{value}', the model's own code, which this server never runs, and "
            f"transformers has no native port of it known here (ported: {ported}); see docs/models.md")
    architectures = [str(name) for name in config.get("architectures") or []]
    heads = {value.rsplit(".", 1)[-1] for key, value in auto_map.items() if key.startswith("AutoModelFor")}
    if family and architectures and (not set(architectures) & set(_KNOWN_CODE[family])
                                     or not set(architectures) <= {*_KNOWN_CODE[family], *heads}):
        raise NativeLayoutError(f"config.json: architectures {architectures}; only the encoder "
                                f"({' or '.join(_KNOWN_CODE[family])}) of this original layout is converted, "
                                "and the checkpoint must be saved as it (other heads of its own code beside it)")
    return family


def _served_code(config: dict[str, Any], auto_map: dict[str, Any]) -> tuple[str, str] | None:
    """The `auto_map` entry (key, code) whose class the served pipeline would run: the one naming
    the class the checkpoint was saved as (`architectures`), else the encoder (`AutoModel`).
    Published folders also list the other heads of the same code (nomic's AutoModelForMaskedLM,
    GTE's five AutoModelFor... entries): those are never run, so they decide nothing. A folder
    naming only heads of its own code is decided by the first of them."""
    code = {key: str(value) for key, value in auto_map.items() if key.startswith("AutoModel")}
    saved = {str(name) for name in config.get("architectures") or []}
    for key, value in sorted(code.items()):
        if value.rsplit(".", 1)[-1] in saved:
            return key, value
    if "AutoModel" in code:
        return "AutoModel", code["AutoModel"]
    return min(code.items()) if code else None


def _require(config: dict[str, Any], names: tuple[str, ...], family: str) -> None:
    missing = [name for name in names if name not in config]
    if missing:
        raise NativeLayoutError(f"config.json ({family} original layout) does not say {', '.join(missing)}; their "
                                "defaults live in the model's own code, which is never run")


def _refuse_unless(checks: dict[str, tuple[Any, tuple[Any, ...]]], family: str) -> None:
    """checks: name -> (value, the values the native class computes alike); others are refused."""
    for name, (value, supported) in checks.items():
        if value not in supported:
            allowed = " or ".join(repr(v) for v in supported)
            raise NativeLayoutError(f"config.json ({family} original layout): {name} = {value!r}; transformers' "
                                    f"native class computes {name} = {allowed} only, so it cannot serve this model "
                                    "exactly")


# --- nomic-bert ---------------------------------------------------------------------------------

# The original gated MLP rounds its width up to a multiple of 256 (its NomciBertGatedMLP).
_NOMIC_MLP_MULTIPLE = 256
_NOMIC_GATES = {"swiglu": "silu", "geglu": "gelu", "glu": "sigmoid"}  # y * act(gate), as ACT2FN names


def _nomic_config(config: dict[str, Any]) -> dict[str, Any]:
    _require(config, ("n_embd", "n_layer", "n_head", "n_inner", "vocab_size", "activation_function",
                      "layer_norm_epsilon", "rotary_emb_base", "rotary_emb_fraction", "qkv_proj_bias",
                      "mlp_fc1_bias", "mlp_fc2_bias", "type_vocab_size"), "nomic-bert")
    get = config.get
    _refuse_unless({
        "activation_function": (get("activation_function"), tuple(_NOMIC_GATES)),  # gated MLPs only
        "rotary_emb_fraction": (get("rotary_emb_fraction"), (1, 1.0)),
        "rotary_emb_interleaved": (get("rotary_emb_interleaved", False), (False,)),
        "rotary_emb_scale_base": (get("rotary_emb_scale_base"), (None,)),
        # Dynamic NTK scaling past max_trained_positions: the original's frequencies then depend on
        # earlier, longer batches (it keeps the last scaled ones), which no native rope reproduces.
        "rotary_scaling_factor": (get("rotary_scaling_factor"), (None, 0)),
        "qkv_proj_bias": (get("qkv_proj_bias"), (False,)),
        "mlp_fc1_bias": (get("mlp_fc1_bias"), (False,)),
        "mlp_fc2_bias": (get("mlp_fc2_bias"), (False,)),
        "prenorm": (get("prenorm", False), (False,)),
        "parallel_block": (get("parallel_block", False), (False,)),
        "use_rms_norm": (get("use_rms_norm", False), (False,)),
        "causal": (get("causal", False), (False,)),
        "scale_attn_weights": (get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "num_heads_kv": (get("num_heads_kv"), (None, get("n_head"))),
    }, "nomic-bert")
    if int(get("type_vocab_size")) <= 0:
        raise NativeLayoutError("config.json (nomic-bert original layout): type_vocab_size 0 (no token type "
                                "embeddings); the native class always adds one")
    multiple = int(get("pad_vocab_size_multiple") or 1)
    vocab = -(-int(get("vocab_size")) // multiple) * multiple  # the original pads its vocabulary to a multiple
    native = {
        "vocab_size": vocab,
        "hidden_size": int(get("n_embd")),
        "num_hidden_layers": int(get("n_layer")),
        "num_attention_heads": int(get("n_head")),
        "intermediate_size": -(-int(get("n_inner")) // _NOMIC_MLP_MULTIPLE) * _NOMIC_MLP_MULTIPLE,
        "hidden_act": _NOMIC_GATES[get("activation_function")],
        "layer_norm_eps": float(get("layer_norm_epsilon")),
        # Rotary positions only: n_positions (the original's max_position_embeddings) is the length it runs.
        "max_position_embeddings": int(get("n_positions", 1024)),
        "type_vocab_size": int(get("type_vocab_size")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rotary_emb_base"))},
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
    }
    return _keep_ids(config, native, "nomic-bert", ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "intermediate_size", "layer_norm_eps", "rope_parameters"))


def _nomic_name(name: str) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    name = name.replace("emb_ln.", "embeddings.LayerNorm.", 1) if name.startswith("emb_ln.") else name
    layer = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", name)
    if not layer:
        return [(name, _same)]
    return _layer_weight(f"layers.{layer[1]}.", layer[2], {"attn.Wqkv.": _QKV}, (
        ("attn.out_proj.", "self_attn.o_proj."), ("mlp.fc11.", "mlp.up_proj."), ("mlp.fc12.", "mlp.gate_proj."),
        ("mlp.fc2.", "mlp.down_proj."), ("norm1.", "post_attention_layernorm."), ("norm2.", "post_mlp_layernorm."),
    )) or [(name, _same)]


# --- GTE "new" (gte-*-v1.5, Arctic-embed-m-v2.0) ---------------------------------------------------

def _gte_config(config: dict[str, Any]) -> dict[str, Any]:
    _require(config, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                      "hidden_act", "layer_norm_eps", "max_position_embeddings", "type_vocab_size", "rope_theta"),
             "GTE")
    get = config.get
    from transformers.activations import ACT2FN

    _refuse_unless({
        "position_embedding_type": (get("position_embedding_type", "rope"), ("rope",)),
        "layer_norm_type": (get("layer_norm_type", "layer_norm"), ("layer_norm",)),
        "logn_attention_scale": (get("logn_attention_scale", False), (False,)),
        "logn_attention_clip1": (get("logn_attention_clip1", False), (False,)),
        "pack_qkv": (get("pack_qkv", True), (True, "true")),  # one fused qkv_proj, as conversion_mapping splits
    }, "GTE")
    if get("hidden_act") not in ACT2FN:
        raise NativeLayoutError(f"config.json (GTE original layout): hidden_act {get('hidden_act')!r} is not one of "
                                "transformers' activations")
    head_dim = int(get("hidden_size")) // int(get("num_attention_heads"))
    rope = {"rope_type": "default", "rope_theta": float(get("rope_theta"))}
    scaling = get("rope_scaling")
    if scaling is not None:
        kind = (scaling.get("type") or scaling.get("rope_type")) if isinstance(scaling, dict) else None
        factor = scaling.get("factor") if isinstance(scaling, dict) else None
        if kind != "ntk" or scaling.get("mixed_b") is not None or not isinstance(factor, (int, float)) or factor < 1:
            raise NativeLayoutError(f"config.json (GTE original layout): rope_scaling {scaling!r}; only fixed NTK "
                                    "scaling ({type: ntk, factor >= 1}) maps exactly onto a native rope")
        # The original's fixed NTK scaling (set once, for every length): frequencies of base
        # theta * factor, all divided by factor ** (2 / head_dim) -- a linear rope of that base.
        rope = {"rope_type": "linear", "rope_theta": float(get("rope_theta")) * factor,
                "factor": float(factor) ** (2 / head_dim)}
    native = {name: get(name) for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "intermediate_size", "hidden_act", "layer_norm_eps",
                                           "max_position_embeddings", "type_vocab_size")}
    native.update(rope_parameters=rope, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _keep_ids(config, native, "GTE", ())


def _gte_name(name: str) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    name = name.removeprefix("new.")
    layer = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)", name)
    if not layer:
        return [(name, _same)]
    return _layer_weight(f"layers.{layer[1]}.", layer[2],
                         {"attention.qkv_proj.": _QKV, "mlp.up_gate_proj.": ("mlp.up_proj.", "mlp.gate_proj.")}, (
        ("attention.o_proj.", "self_attn.o_proj."), ("attn_ln.", "post_attention_layernorm."),
        ("mlp.down_proj.", "mlp.down_proj."), ("mlp_ln.", "post_mlp_layernorm."),
    )) or [(name, _same)]


# --- Shared steps -------------------------------------------------------------------------------

def _keep_ids(config: dict[str, Any], native: dict[str, Any], family: str, same: tuple[str, ...]) -> dict[str, Any]:
    """The token ids and dtype carried over as they are; a native field the original config also
    states (some published configs carry both) must agree with the mapped value."""
    for name in same:
        if name in config and config[name] != native[name]:
            raise NativeLayoutError(f"config.json ({family} original layout): {name} = {config[name]!r} disagrees "
                                    f"with the original fields, which give {native[name]!r}")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "initializer_range"):
        if config.get(name) is not None:
            native[name] = config[name]
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype:
        native["dtype"] = dtype
    return native


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


_QKV = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")


def _layer_weight(prefix: str, rest: str, fused: dict[str, tuple[str, ...]], renamed: tuple[tuple[str, str], ...]
                  ) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] | None:
    """A layer's weight `rest` under its native names: a fused weight split in equal row blocks,
    one per native part, or renamed; None where neither table names it (it keeps its name)."""
    for old, parts in fused.items():
        if rest.startswith(old):
            kind = rest.removeprefix(old)
            return [(f"{prefix}{part}{kind}", _chunk(i, len(parts))) for i, part in enumerate(parts)]
    for old, new in renamed:
        if rest.startswith(old):
            return [(prefix + new + rest.removeprefix(old), _same)]
    return None


def _chunk(index: int, parts: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def take(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape[0] % parts:
            raise NativeLayoutError(f"a fused weight of {tensor.shape[0]} rows does not split into {parts} equal parts")
        return tensor.chunk(parts, dim=0)[index].clone()

    return take


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(folder / name)))
    return weights


def _rename_all(weights: dict[str, torch.Tensor], renamer) -> dict[str, torch.Tensor]:
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        for new_name, transform in renamer(name):
            if new_name in renamed:
                raise NativeLayoutError(f"two original weights map to the native weight {new_name}")
            renamed[new_name] = transform(tensor)
    return renamed


def _check_weights(native: dict[str, Any], native_class: str, renamed: dict[str, torch.Tensor]):
    """The native config object, once the renamed weights are exactly the native model's (names
    and shapes; built on the meta device, so nothing is allocated)."""
    import transformers

    model_class = getattr(transformers, native_class)
    config = model_class.config_class(**native)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in model_class(config).state_dict().items()}
    missing = sorted(set(expected) - set(renamed))
    unexpected = sorted(set(renamed) - set(expected))
    if missing or unexpected:
        raise NativeLayoutError(f"the weights do not match transformers' {native_class} for this config: "
                                f"missing {_names(missing)}; unexpected {_names(unexpected)}")
    shapes = [f"{name} {tuple(renamed[name].shape)} (expected {shape})" for name, shape in sorted(expected.items())
              if tuple(renamed[name].shape) != shape]
    if shapes:
        raise NativeLayoutError(f"weights of the wrong shape for {native_class}: {', '.join(shapes[:5])}")
    return config


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


_FAMILIES = {"nomic": ("NomicBertModel", _nomic_config, _nomic_name), "gte": ("GteModel", _gte_config, _gte_name)}
