"""Copies of a sentence-transformers model folder with its pipeline rearranged: the references
for what `"normalize": false` serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def _edited(model_dir: Path, dest: Path, edit) -> Path:
    shutil.copytree(model_dir, dest)
    modules = json.loads((dest / "modules.json").read_text())
    (dest / "modules.json").write_text(json.dumps(edit(modules)))
    return dest


def without_normalize(model_dir: Path, dest: Path) -> Path:
    """The model without its Normalize modules: sentence-transformers on it with
    normalize_embeddings=False gives the vector before normalization."""
    return _edited(model_dir, dest, lambda modules: [m for m in modules if not m["type"].endswith(".Normalize")])


def normalize_before_dense(model_dir: Path, dest: Path) -> Path:
    """A Pooling, Dense, Normalize model rearranged to Pooling, Normalize, Dense."""
    def edit(modules):
        normalize = next(m for m in modules if m["type"].endswith(".Normalize"))
        rest = [m for m in modules if m is not normalize]
        at = next(i for i, m in enumerate(rest) if m["type"].endswith(".Dense"))
        reordered = [*rest[:at], normalize, *rest[at:]]
        return [{**m, "idx": i, "name": str(i)} for i, m in enumerate(reordered)]

    return _edited(model_dir, dest, edit)
