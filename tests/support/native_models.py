"""Tiny random models of the families transformers now runs natively that are published in their
original remote-code layout, made offline.

Each family is first made as a NATIVE sentence-transformers folder (NomicBertModel / GteModel,
the reference sentence-transformers runs), then written again in the ORIGINAL layout a user
downloads: the original config keys and `auto_map`, and the weights as the original checkpoints
name them (the inverse of transformers' conversion_mapping.py). The server's build must turn the
second back into the first.

    nomic    nomic-embed-text-v1.5: GPT-2 style config (n_embd, n_inner, rotary_emb_base, swiglu, a
             vocabulary padded to a multiple of 64), fused attn.Wqkv, fc11/fc12/fc2, norm1/norm2,
             emb_ln; mean pooling, Normalize, search_query: / search_document: prompts
    gte      gte-base-en-v1.5: model_type "new", no token types, rope_theta 500000 with fixed NTK
             scaling (factor 2), weights under `new.`, fused qkv_proj and up_gate_proj; CLS pooling
    arctic   snowflake-arctic-embed-m-v2.0: the same code as model_type "gte" with auto_map, one token
             type, pad id 1, rope_theta 160000 and NTK factor 8; CLS pooling, Normalize, a query prompt
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GteConfig, GteModel, NomicBertConfig, NomicBertModel

from tests.support.model_families import NORMALIZE_MODULE, _bert_tokenizer, _pooling, _st_files

NATIVE_FAMILIES = ("nomic", "gte", "arctic")
HIDDEN, HEADS, LAYERS = 32, 4, 2
NOMIC_MLP, GTE_MLP = 256, 64  # nomic's gated MLP width is a multiple of 256 (the original rounds it up)
NOMIC_PROMPTS = {"query": "search_query: ", "document": "search_document: "}
ARCTIC_PROMPTS = {"query": "query: "}
# The auto_maps as nomic-embed-text-v1.5's and gte-base-en-v1.5's config.json publish them: the
# encoder beside the other heads of the same code, which the server never runs.
NOMIC_AUTO_MAP = {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                  "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel",
                  "AutoModelForMaskedLM": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertForPreTraining"}
GTE_AUTO_MAP = {"AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
                "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
                **{f"AutoModelFor{head}": f"Alibaba-NLP/new-impl--modeling.NewFor{head}" for head in (
                    "MaskedLM", "MultipleChoice", "QuestionAnswering", "SequenceClassification",
                    "TokenClassification")}}
ARCTIC_AUTO_MAP = {"AutoConfig": "configuration_hf_alibaba_nlp_gte.GteConfig",
                   "AutoModel": "modeling_hf_alibaba_nlp_gte.GteModel"}
# The GTE shapes' rotary settings as their original configs state them: (rope_theta, NTK factor).
GTE_ROPE = {"gte": (500000.0, 2.0), "arctic": (160000.0, 8.0), "gte-multilingual": (20000.0, 8.0)}


def make_native_and_original(family: str, root: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """(the native folder, the same model in its original layout) under `root`."""
    native = make_native(family, root / f"{family}-native", seed=seed)
    return native, write_original(family, native, root / f"{family}-original")


def make_native(family: str, path: Path, *, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = _bert_tokenizer(path, 128)
    vocab = -(-len(tokenizer) // 64) * 64 if family == "nomic" else len(tokenizer)  # nomic pads to a multiple of 64
    model = native_model(family, vocab_size=vocab, pad_token_id=tokenizer.pad_token_id if family != "arctic" else 1)
    if family == "nomic":
        pipeline, st = [_pooling(HIDDEN, "mean"), NORMALIZE_MODULE], dict(prompts=NOMIC_PROMPTS)
    else:
        pipeline = [_pooling(HIDDEN, "cls")] + ([NORMALIZE_MODULE] if family == "arctic" else [])
        st = dict(prompts=ARCTIC_PROMPTS if family == "arctic" else None)
    save_native(model, path)
    _st_files(path, pipeline, max_seq_length=64, **st)
    return path


def native_model(family: str, *, vocab_size: int, pad_token_id: int) -> torch.nn.Module:
    """A random model of `family` in transformers' native port, LAYERS layers of HIDDEN width, the
    rotary and MLP settings its original config states (nomic's MLP width as the original rounds it)."""
    small = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, layer_norm_eps=1e-12,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "nomic":
        model = NomicBertModel(NomicBertConfig(
            vocab_size=vocab_size, intermediate_size=NOMIC_MLP, hidden_act="silu", max_position_embeddings=512,
            type_vocab_size=2, pad_token_id=pad_token_id,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **small))
    elif family in GTE_ROPE:
        theta, factor = GTE_ROPE[family]
        head_dim = HIDDEN // HEADS
        model = GteModel(GteConfig(
            vocab_size=vocab_size, intermediate_size=GTE_MLP, hidden_act="gelu", max_position_embeddings=512,
            type_vocab_size=0 if family == "gte" else 1, pad_token_id=pad_token_id,
            # What the original's fixed NTK scaling computes, as the build maps it (embedserve/archive/native.py);
            # tests/unit/test_native_families.py checks these frequencies against the original's formula.
            rope_parameters={"rope_type": "linear", "rope_theta": theta * factor,
                             "factor": factor ** (2 / head_dim)}, **small))
    else:
        raise ValueError(f"unknown family {family}; known: {', '.join(NATIVE_FAMILIES)}")
    with torch.no_grad():  # livelier than the 0.02 initialization, so that vectors differ clearly
        for name, parameter in model.named_parameters():
            if name.endswith("weight") and parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    return model


def save_native(model: torch.nn.Module, path: Path) -> None:
    """The config and the weights under their native names, written as they are: save_pretrained
    would write the original checkpoint's names back (transformers 5 reverses conversion_mapping.py)."""
    model.config.save_pretrained(path)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})


def write_original(family: str, native: Path, path: Path) -> Path:
    """`native` (a make_native folder) in its original remote-code layout at `path`."""
    shutil.copytree(native, path, ignore=shutil.ignore_patterns("config.json", "model.safetensors"))
    for sub in native.iterdir():  # the pipeline modules' own config.json files stay
        if sub.is_dir():
            shutil.copytree(sub, path / sub.name, dirs_exist_ok=True)
    config = json.loads((native / "config.json").read_text())
    original = _nomic_original(config) if family == "nomic" else _gte_original(family, config)
    (path / "config.json").write_text(json.dumps(original, indent=2))
    save_original_weights(family, load_file(str(native / "model.safetensors")), path)
    return path


def save_original_weights(family: str, native: dict[str, torch.Tensor], path: Path,
                          head: dict[str, torch.Tensor] | None = None) -> None:
    """The native weights under the names the original checkpoints have, at path/model.safetensors,
    with a head's own weights beside them (`head`, as a checkpoint saved with that head holds them)."""
    if family == "nomic":
        tensors = _nomic_weights(native)
    else:  # gte-*-v1.5's and gte-multilingual-base's checkpoints keep NewModel's prefix
        tensors = _gte_weights(native, "" if family == "arctic" else "new.")
    save_file({**tensors, **(head or {})}, str(path / "model.safetensors"), metadata={"format": "pt"})


def _nomic_original(config: dict) -> dict:
    # Keys and values as nomic-embed-text-v1.5's config.json has them (a GPT2Config subclass).
    return {
        "architectures": ["NomicBertModel"], "auto_map": NOMIC_AUTO_MAP, "model_type": "nomic_bert",
        "activation_function": "swiglu", "attn_pdrop": 0.0, "bos_token_id": None, "causal": False,
        "dense_seq_output": True, "embd_pdrop": 0.0, "eos_token_id": None, "fused_bias_fc": True,
        "fused_dropout_add_ln": True, "initializer_range": 0.02, "layer_norm_epsilon": config["layer_norm_eps"],
        "max_trained_positions": 2048, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
        "n_embd": config["hidden_size"], "n_head": config["num_attention_heads"],
        "n_inner": config["intermediate_size"], "n_layer": config["num_hidden_layers"],
        "n_positions": config["max_position_embeddings"],
        "pad_vocab_size_multiple": 64, "parallel_block": False, "parallel_block_tied_norm": False, "prenorm": False,
        "qkv_proj_bias": False, "reorder_and_upcast_attn": False, "resid_pdrop": 0.0,
        "rotary_emb_base": config["rope_parameters"]["rope_theta"], "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
        "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True, "torch_dtype": "float32",
        "type_vocab_size": config["type_vocab_size"], "use_cache": True, "use_flash_attn": True,
        "use_rms_norm": False, "use_xentropy": True,
        # The vocabulary before padding (the original pads it to pad_vocab_size_multiple itself).
        "vocab_size": config["vocab_size"] - 5,
    }


def _nomic_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in weights.items():
        if name.startswith("embeddings.LayerNorm."):
            out[name.replace("embeddings.LayerNorm.", "emb_ln.")] = tensor
        elif name.startswith("layers."):
            index, rest = name.split(".", 2)[1:]
            prefix = f"encoder.layers.{index}."
            if rest.startswith("self_attn.q_proj."):
                kind = rest.rsplit(".", 1)[-1]
                parts = [weights[f"layers.{index}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
                out[f"{prefix}attn.Wqkv.{kind}"] = torch.cat(parts, 0)
            elif rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                continue
            else:
                for new, old in (("self_attn.o_proj.", "attn.out_proj."), ("mlp.up_proj.", "mlp.fc11."),
                                 ("mlp.gate_proj.", "mlp.fc12."), ("mlp.down_proj.", "mlp.fc2."),
                                 ("post_attention_layernorm.", "norm1."), ("post_mlp_layernorm.", "norm2.")):
                    if rest.startswith(new):
                        out[prefix + old + rest.removeprefix(new)] = tensor
        else:
            out[name] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _gte_original(family: str, config: dict) -> dict:
    theta, factor = GTE_ROPE[family]
    # The keys of Alibaba-NLP/new-impl's NewConfig, as gte-base-en-v1.5 / arctic-embed-m-v2.0 state them.
    return {
        "architectures": ["NewModel" if family == "gte" else "GteModel"],
        "auto_map": GTE_AUTO_MAP if family == "gte" else ARCTIC_AUTO_MAP,
        "model_type": "new" if family == "gte" else "gte",
        **{name: config[name] for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "intermediate_size", "hidden_act", "layer_norm_eps",
                                           "max_position_embeddings", "type_vocab_size", "pad_token_id")},
        "attention_probs_dropout_prob": 0.0, "classifier_dropout": None, "hidden_dropout_prob": 0.1,
        "initializer_range": 0.02, "layer_norm_type": "layer_norm", "logn_attention_clip1": False,
        "logn_attention_scale": False, "pack_qkv": True, "position_embedding_type": "rope",
        "rope_scaling": {"type": "ntk", "factor": factor}, "rope_theta": theta, "torch_dtype": "float32",
        "unpad_inputs": family == "arctic", "use_memory_efficient_attention": family == "arctic",
    }


def _gte_weights(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in weights.items():
        if not name.startswith("layers."):
            out[prefix + name] = tensor
            continue
        index, rest = name.split(".", 2)[1:]
        layer = f"{prefix}encoder.layer.{index}."
        if rest.startswith("self_attn.q_proj."):
            kind = rest.rsplit(".", 1)[-1]
            parts = [weights[f"layers.{index}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"{layer}attention.qkv_proj.{kind}"] = torch.cat(parts, 0)
        elif rest == "mlp.up_proj.weight":  # the original's up_gate_proj: up rows, then gate rows
            gate = weights[f"layers.{index}.mlp.gate_proj.weight"]
            out[f"{layer}mlp.up_gate_proj.weight"] = torch.cat([tensor, gate])
        elif rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.")):
            continue
        else:
            for new, old in (("self_attn.o_proj.", "attention.o_proj."), ("post_attention_layernorm.", "attn_ln."),
                             ("mlp.down_proj.", "mlp.down_proj."), ("post_mlp_layernorm.", "mlp_ln.")):
                if rest.startswith(new):
                    out[layer + old + rest.removeprefix(new)] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def original_ntk_inv_freq(theta: float, factor: float, head_dim: int) -> torch.Tensor:
    """The original GTE code's fixed NTK frequencies (its NTKScalingRotaryEmbedding, set once at
    load for every length): base theta * factor, divided by factor ** (2 / head_dim)."""
    inv_freq = 1.0 / ((theta * factor) ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return inv_freq / factor ** (2 / head_dim)


# --- EmbeddingGemma and jina-embeddings-v3 ----------------------------------------------------------

# EmbeddingGemma's prompts (embeddinggemma-300m's config_sentence_transformers.json names more tasks).
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: ",
                 "Classification": "task: classification | query: "}
GEMMA_SLIDING_WINDOW = 16  # as config.json states it; bidirectional layers see |i - j| < 16 // 2 + 1
# jina-embeddings-v3's original config.json, as published (its own XLMRobertaLoRA code).
JINA_V3_AUTO_MAP = {"AutoConfig": "jinaai/xlm-roberta-flash-implementation--configuration_xlm_roberta."
                                  "XLMRobertaFlashConfig",
                    "AutoModel": "jinaai/xlm-roberta-flash-implementation--modeling_lora.XLMRobertaLoRA",
                    "AutoModelForMaskedLM": "jinaai/xlm-roberta-flash-implementation--modeling_xlm_roberta."
                                            "XLMRobertaForMaskedLM",
                    "AutoModelForPreTraining": "jinaai/xlm-roberta-flash-implementation--modeling_xlm_roberta."
                                               "XLMRobertaForPreTraining"}
JINA_V3_TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")
JINA_V3_CONFIG = {"architectures": ["XLMRobertaLoRA"], "auto_map": JINA_V3_AUTO_MAP, "model_type": "xlm-roberta",
                  "lora_adaptations": list(JINA_V3_TASKS), "lora_alpha": 1, "lora_rank": 4,
                  "load_trained_adapters": True, "position_embedding_type": "rotary", "rotary_emb_base": 20000.0,
                  "matryoshka_dimensions": [32, 64, 128, 256, 512, 768, 1024]}


def make_embeddinggemma(path: Path, *, seed: int = 0) -> Path:
    """The embeddinggemma-300m shape, made and saved by sentence-transformers' own classes: a
    Gemma3TextModel with bidirectional attention (sliding-window and full layers, grouped keys),
    Gemma's tokenizer (<bos> ... <eos>, left padding), mean pooling, two Dense layers without bias
    or activation (hidden -> 4 hidden -> hidden), Normalize, and its task prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import Gemma3TextConfig, Gemma3TextModel
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    from tests.support.model_families import corpus

    torch.manual_seed(seed)
    backbone = path.parent / f"{path.name}-backbone"
    tokenizer = GemmaTokenizer(add_bos_token=True, add_eos_token=True, model_max_length=2048)
    tokenizer = tokenizer.train_new_from_iterator(corpus(), vocab_size=300)
    tokenizer.save_pretrained(backbone)
    model = Gemma3TextModel(Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=HEADS, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=GEMMA_SLIDING_WINDOW, max_position_embeddings=256, use_bidirectional_attention=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id))
    with torch.no_grad():  # livelier than the initialization (zero RMSNorm weights), so that vectors differ clearly
        for name, parameter in model.named_parameters():
            parameter.normal_(0, 0.2 if parameter.dim() == 2 else 0.3)
    model.eval().save_pretrained(backbone)
    width = 4 * HIDDEN
    identity = torch.nn.Identity()
    modules = [Transformer(str(backbone), max_seq_length=64), Pooling(HIDDEN, "mean"),
               Dense(HIDDEN, width, bias=False, activation_function=identity),
               Dense(width, HIDDEN, bias=False, activation_function=identity), Normalize()]
    SentenceTransformer(modules=modules, prompts=GEMMA_PROMPTS, device="cpu").save(str(path))
    shutil.rmtree(backbone)
    return path


# --- EuroBERT -------------------------------------------------------------------------------------

EUROBERT_PROMPTS = {"query": "query: ", "document": "document: "}


def make_eurobert(path: Path, *, seed: int = 0) -> Path:
    """The EuroBERT shape (transformers' native EuroBertModel: Llama layers with bidirectional
    attention, rotary positions, grouped keys, RMSNorm), made and saved by sentence-transformers'
    own classes: a byte-level BPE tokenizer that writes <|begin_of_text|> ... <|end_of_text|> and
    pads with <|end_of_text|> (as EuroBERT's pad and eos ids are one), mean pooling, Normalize, prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import EuroBertConfig, EuroBertModel

    from tests.support.model_families import _save_tokenizer, corpus

    torch.manual_seed(seed)
    backbone = path.parent / f"{path.name}-backbone"
    bos, eos, mask = "<|begin_of_text|>", "<|end_of_text|>", "<|mask|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=[bos, eos, mask], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}",
        special_tokens=[(bos, tokenizer.token_to_id(bos)), (eos, tokenizer.token_to_id(eos))])
    fast = _save_tokenizer(tokenizer, backbone, 8192, bos_token=bos, eos_token=eos, pad_token=eos, mask_token=mask)
    model = EuroBertModel(EuroBertConfig(
        vocab_size=len(fast), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, mask_token_id=fast.mask_token_id))
    with torch.no_grad():  # livelier than the initialization (RMSNorm weights all one), so that vectors differ clearly
        for parameter in model.parameters():
            parameter.normal_(1.0 if parameter.dim() == 1 else 0.0, 0.3 if parameter.dim() == 1 else 0.2)
    model.eval().save_pretrained(backbone)
    modules = [Transformer(str(backbone), max_seq_length=64), Pooling(HIDDEN, "mean"), Normalize()]
    SentenceTransformer(modules=modules, prompts=EUROBERT_PROMPTS, device="cpu").save(str(path))
    shutil.rmtree(backbone)
    return path
