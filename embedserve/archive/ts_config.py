"""Read and edit TorchServe's config.properties in place, keeping every other line and comment.

The build rewrites three properties: the `models=` JSON, `load_models` and `job_queue_size`.
Java properties continue a value onto the next line with a trailing backslash, as `models=` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Queue room for this many full batches per worker before TorchServe answers 503.
QUEUED_BATCHES_PER_WORKER = 8
MIN_JOB_QUEUE_SIZE = 100  # TorchServe's own default


def read_properties(path: Path) -> dict[str, str]:
    return {key: value for key, value, _ in _logical_lines(path.read_text().splitlines())}


def register_model(path: Path, name: str, version: str, entry: dict[str, Any]) -> None:
    """Add or replace one model version in `models=` and list every configured .mar in `load_models`."""
    models = json.loads(read_properties(path).get("models") or "{}")
    for other in models.get(name, {}).values():
        other["defaultVersion"] = False
    models.setdefault(name, {})[version] = entry

    mars = sorted({v["marName"] for versions in models.values() for v in versions.values()})
    queue = max(
        [MIN_JOB_QUEUE_SIZE]
        + [v["batchSize"] * v["maxWorkers"] * QUEUED_BATCHES_PER_WORKER for vs in models.values() for v in vs.values()]
    )
    update_properties(path, {
        "models": _continued_json(models),
        "load_models": ",".join(mars),
        "job_queue_size": str(queue),
    })


def update_properties(path: Path, updates: dict[str, str]) -> None:
    """Set each property in place (appending the ones not there yet), keeping all other lines."""
    path.write_text("\n".join(_apply(path.read_text().splitlines(), updates)) + "\n")


def _continued_json(value: Any) -> str:
    return "\\\n".join(json.dumps(value, indent=2).splitlines())


def _logical_lines(lines: list[str]):
    """Yield (key, value, (first, last) line indices) for each property, joining continuations."""
    i = 0
    while i < len(lines):
        first = i
        stripped = lines[i].strip()
        if not stripped or stripped.startswith(("#", "!")) or "=" not in stripped:
            i += 1
            continue
        parts = [lines[i]]
        while parts[-1].endswith("\\") and i + 1 < len(lines):
            parts[-1] = parts[-1][:-1]
            i += 1
            parts.append(lines[i].strip())
        if parts[-1].endswith("\\"):
            parts[-1] = parts[-1][:-1]
        key, _, value = "".join(parts).partition("=")
        yield key.strip(), value.strip(), (first, i)
        i += 1


def _apply(lines: list[str], updates: dict[str, str]) -> list[str]:
    spans = {key: span for key, _, span in _logical_lines(lines)}
    out = list(lines)
    # Replace from the bottom up so earlier spans keep their indices.
    for key, (first, last) in sorted(((k, spans[k]) for k in updates if k in spans), key=lambda kv: -kv[1][0]):
        out[first : last + 1] = f"{key}={updates[key]}".splitlines()
    out.extend(f"{key}={value}" for key, value in updates.items() if key not in spans)
    return out
