"""SHA-256 of files, read in chunks so large weights never sit in memory twice."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable


def sha256_files(paths: Iterable[Path]) -> str:
    """One hex digest over the files' contents, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
