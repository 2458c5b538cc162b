"""Pack folders into one .xz tar for a device call: `python scripts/pack_xz.py TARGET ROOT NAME... [--weights]`.

One xz stream (better than xz -T's blocks), written beside the target and moved into place, so an
interrupted run leaves no half archive. `--weights`: the files are mostly 16-bit numbers, and
LZMA2 told so (lc=0, lp=1, pb=1) packs them 5% tighter."""

from __future__ import annotations

import lzma
import os
import sys
import tarfile
import time
from pathlib import Path


def pack(root: Path, target: Path, names: list[str], *, weights: bool = False) -> None:
    started = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    lzma2 = {"lc": 0, "lp": 1, "pb": 1} if weights else {}
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, **lzma2}]
    with lzma.open(partial, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters) as raw, \
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            tar.add(root / name, arcname=name)
    os.replace(partial, target)
    print(f"{target}: {target.stat().st_size / 2**20:.2f} MiB in {time.monotonic() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    args = [arg for arg in sys.argv[1:] if arg != "--weights"]
    pack(Path(args[1]), Path(args[0]), args[2:], weights="--weights" in sys.argv)
