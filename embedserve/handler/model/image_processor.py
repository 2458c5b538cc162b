"""A model folder's image processor, loaded once a process.

The description reads its figures (model/towers.py: SigLIP 2's patch size and patch bound;
model/pages.py: ColQwen2's patch size, merge and pixel bound) and the image preparation runs it
(inputs/image.py). Loading it reads its files and builds its transforms: done once, the worker's
start pays for it once. The key holds the modification times of the processor's files, so a
folder rewritten in place is read afresh.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def image_processor(model_dir: str | Path) -> Any:
    """transformers' `AutoImageProcessor` of the folder (its errors are the caller's to word)."""
    folder = Path(model_dir).resolve()
    stamps = tuple((folder / name).stat().st_mtime_ns if (folder / name).is_file() else 0 for name in PROCESSOR_FILES)
    return _load(folder, stamps)


@functools.lru_cache(maxsize=4)  # a worker serves one model; a build describes a few
def _load(folder: Path, stamps: tuple[int, ...]) -> Any:
    from transformers import AutoImageProcessor  # the image models' dependency only

    return AutoImageProcessor.from_pretrained(folder)
