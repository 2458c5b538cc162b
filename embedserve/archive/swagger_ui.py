"""Swagger UI for the API page (embedserve/handler/api/docs_page.py), from the npm registry.

swagger-ui-dist at a pinned version, fetched with npm (`npm pack`, which follows the npm
configuration: registry, proxy, certificates), checked against its pinned integrity hash, and
kept in build/swagger-ui/ (ignored by git), so that later builds, offline ones too, take it from
there. The build copies only the files the page uses (docs_page.ASSETS, with the licence and
notice) into the archive's swagger-ui/ folder: 1.9 MB, 0.5 MB compressed in the .mar.

When it cannot be had (no npm, no registry), the build still makes the archive, without the page,
and says so; the page then answers 404 saying how to build it in.

    python -m embedserve.archive.swagger_ui    # fetch and check it alone
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from embedserve.handler.api.docs_page import ASSETS, ASSETS_FOLDER

PACKAGE = "swagger-ui-dist"
VERSION = "5.35.0"
# The registry's `dist.integrity` of that version (npm view swagger-ui-dist@5.35.0 dist.integrity).
INTEGRITY = "sha512-U06rpMtW9V3XPGOBeamTUSr0Z09jMX4IJuANpE/EZbAhw0G8CgwrzU4YmXkn/h0wCDNsXdGarTNNHC3sU8yVUQ=="
CACHE = Path(__file__).resolve().parents[2] / "build" / "swagger-ui"
NPM_TIMEOUT_S = 180


class AssetsError(RuntimeError):
    pass


def tarball(cache: Path = CACHE) -> Path:
    """The verified tarball, fetched into `cache` on first use."""
    path = cache / f"{PACKAGE}-{VERSION}.tgz"
    if path.is_file() and integrity(path) == INTEGRITY:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        fetched = _npm_pack(Path(tmp))
        found = integrity(fetched)
        if found != INTEGRITY:
            raise AssetsError(f"{fetched.name} from the npm registry has integrity {found}, not the pinned "
                              f"{INTEGRITY}: refusing it")
        os.replace(fetched, path)  # whole or not at all, should two builds fetch at once
    return path


def integrity(path: Path) -> str:
    """npm's integrity string of a file: sha512-<base64 digest>."""
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def _npm_pack(folder: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise AssetsError("npm is not installed (Node.js's package manager; `apt-get install npm`)")
    command = [npm, "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", str(folder), "--ignore-scripts",
               "--prefer-offline", "--fetch-retries=1", "--fetch-timeout=30000", "--loglevel=error"]
    try:
        # Run in the empty folder: npm reads no project of ours.
        result = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssetsError(f"npm pack {PACKAGE}@{VERSION} took over {NPM_TIMEOUT_S} s") from None
    path = folder / f"{PACKAGE}-{VERSION}.tgz"
    if result.returncode != 0 or not path.is_file():
        raise AssetsError(f"npm pack {PACKAGE}@{VERSION} failed: {_npm_error(result.stderr or result.stdout)}")
    return path


def _npm_error(output: str) -> str:
    """npm's error in a line: its code and message, without the stack trace and the log's path."""
    lines = []
    for line in output.splitlines():
        line = line.removeprefix("npm error").strip()
        if line.startswith(("at ", "A complete log")):
            break
        if line:
            lines.append(line)
    return "; ".join(lines[:4]) or "no output"


def extract(archive: Path, folder: Path) -> int:
    """The page's files from the tarball into `folder`; their total size in bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    with tarfile.open(archive, "r:gz") as tar:
        for name in ASSETS:
            member = tar.getmember(f"package/{name}")
            if not member.isfile():
                raise AssetsError(f"{archive.name}: package/{name} is not a file")
            data = tar.extractfile(member).read()
            (folder / name).write_bytes(data)
            total += len(data)
    return total


def stage_assets(stage: Path, cache: Path = CACHE) -> str:
    """Put the page's files in the archive's stage, in swagger-ui/; a line for the build's output
    saying what it put there, or that the archive goes without the page, and why."""
    try:
        size = extract(tarball(cache), stage / ASSETS_FOLDER)
    except (AssetsError, OSError, KeyError, tarfile.TarError) as err:
        shutil.rmtree(stage / ASSETS_FOLDER, ignore_errors=True)  # no half page
        return (f"warning: this archive has NO API page (<version>/docs answers 404): {PACKAGE} {VERSION} could "
                f"not be had ({err}); build where npm reaches its registry to include it, or fetch it alone there "
                f"with `python -m embedserve.archive.swagger_ui` and carry {cache} to this machine")
    return f"API page (<version>/docs): {PACKAGE} {VERSION}, {len(ASSETS)} files, {size / 1e6:.1f} MB"


def main() -> int:
    try:
        path = tarball()
    except AssetsError as err:
        print(f"swagger_ui: error: {err}", file=sys.stderr)
        return 1
    print(f"{path} ({INTEGRITY})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
