"""A built archive (.mar) opened where a Ray actor runs: its files unpacked once per node (the
actors of one node share them), and the handler settings, model name and response timeout it
was built with, so an actor runs what a TorchServe worker of the archive runs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from embedserve.handler.settings import Settings

# TorchServe's default when model-config.yaml sets none (embedserve/handler/torchserve/entry.py).
DEFAULT_RESPONSE_TIMEOUT_S = 120.0
UNPACKED = Path(tempfile.gettempdir()) / "embedserve-archives"


@dataclass(frozen=True)
class Archive:
    model_dir: Path
    settings: Settings
    model_name: str
    version: str
    response_timeout_s: float


def open_archive(path: str | Path, into: Path = UNPACKED) -> Archive:
    """The archive at `path` (which every node reads: a shared file system or the same path on
    each), unpacked under `into` in a folder named by its content's hash."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no archive at {path}: build one with ./build_mar.sh (the README)")
    folder = into / _digest(path)
    if not folder.is_dir():
        _unpack(path, folder)
    config = yaml.safe_load((folder / "model-config.yaml").read_text()) or {}
    manifest = json.loads((folder / "MAR-INF" / "MANIFEST.json").read_text())["model"]
    settings = Settings.from_mapping(config.get("handler"))
    return Archive(model_dir=folder / settings.model_path, settings=settings, model_name=manifest["modelName"],
                   version=str(manifest.get("modelVersion") or "1.0"),
                   response_timeout_s=float(config.get("responseTimeout") or DEFAULT_RESPONSE_TIMEOUT_S))


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()[:24]


def _unpack(path: Path, folder: Path) -> None:
    """Into a private folder first, then renamed into place: the actors of a node that unpack
    the same archive at once each get a complete folder, and the first rename wins."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(partial)
        os.rename(partial, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
