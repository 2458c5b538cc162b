"""TorchServe's metrics configuration with the handler's metrics declared in it.

In Prometheus mode TorchServe exports only metrics its configuration declares, and reads that
configuration once, at start-up, from `metrics_config` in config.properties. So the build writes
TorchServe's own default configuration plus `embedserve.handler.worker.metrics.ALL`, ships a copy in the archive,
and points config.properties at it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from embedserve.handler.worker.metrics import ALL

TORCHSERVE_DIMENSIONS = ["ModelName", "Level"]  # added by TorchServe's metric API to every model metric


def torchserve_default_config() -> dict:
    # Found without importing TorchServe: only the handler adapter imports it.
    spec = importlib.util.find_spec("ts")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("TorchServe (the ts package) is not installed")
    default = Path(next(iter(spec.submodule_search_locations))) / "configs" / "metrics.yaml"
    return yaml.safe_load(default.read_text())


def metrics_config() -> dict:
    config = torchserve_default_config()
    sections = config.setdefault("model_metrics", {})
    for spec in ALL:
        entries = sections.setdefault(spec.kind, [])
        if spec.name not in {entry["name"] for entry in entries}:
            entries.append({"name": spec.name, "unit": spec.unit,
                            "dimensions": [*spec.dimensions, *TORCHSERVE_DIMENSIONS]})
    return config


def write_metrics_config(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(metrics_config(), sort_keys=False))
    return path
