"""What a model folder says about itself, from its sentence-transformers files.

sentence-transformers describes a model's pipeline in `modules.json`; the Pooling module's folder
holds `config.json` with the pooling mode, `sentence_bert_config.json` holds the max sequence
length it was trained with (often shorter than the tokenizer's limit), and
`config_sentence_transformers.json` holds named prompts ("query: ", ...) and the default one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

POOLING_MODULE = "sentence_transformers.models.Pooling"

# Pooling config flags (older files) and their mode names (newer files use "pooling_mode").
_FLAG_TO_MODE = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last_token",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_MODE_ALIASES = {"lasttoken": "last_token", "mean_tokens": "mean", "cls_token": "cls"}


class ModelFilesError(ValueError):
    """A model folder is missing a file or describes something this server cannot do."""


@dataclass(frozen=True)
class ModelDescription:
    pooling: str | None  # None when the folder does not say
    max_seq_length: int | None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


def describe_model(model_dir: str | Path) -> ModelDescription:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelFilesError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    prompts, default_prompt_name = _read_prompts(model_dir)
    return ModelDescription(
        pooling=_read_pooling(model_dir),
        max_seq_length=_read_max_seq_length(model_dir),
        prompts=prompts,
        default_prompt_name=default_prompt_name,
    )


def _read_pooling(model_dir: Path) -> str | None:
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_dirs = [m.get("path", "") for m in modules if m.get("type") == POOLING_MODULE]
    if not pooling_dirs:
        return None
    config_file = model_dir / pooling_dirs[0] / "config.json"
    if not config_file.is_file():
        raise ModelFilesError(f"modules.json names a Pooling module but {config_file} is missing")
    config = json.loads(config_file.read_text())
    if isinstance(config.get("pooling_mode"), str):
        modes = [_MODE_ALIASES.get(config["pooling_mode"], config["pooling_mode"])]
    else:
        modes = [mode for flag, mode in _FLAG_TO_MODE.items() if config.get(flag)]
    if len(modes) != 1:
        raise ModelFilesError(f"{config_file} enables {modes or 'no'} pooling modes; exactly one is supported")
    return modes[0]


def _read_max_seq_length(model_dir: Path) -> int | None:
    config_file = model_dir / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    value = json.loads(config_file.read_text()).get("max_seq_length")
    return int(value) if value else None


def _read_prompts(model_dir: Path) -> tuple[dict[str, str], str | None]:
    config_file = model_dir / "config_sentence_transformers.json"
    if not config_file.is_file():
        return {}, None
    config = json.loads(config_file.read_text())
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelFilesError(f"{config_file}: 'prompts' must map names to strings")
    default = config.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise ModelFilesError(f"{config_file}: default_prompt_name '{default}' is not among the prompts")
    return dict(prompts), default
