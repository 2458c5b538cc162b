"""Keep the figures of the last `make image` and image test with the CPU they ran on.

    python scripts/image/record.py [OUT] [--notes TEXT]    (default bench/results/image-cpu.json)

--notes: how the figures were taken (a build from nothing or with cached layers, the machine's load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return {"model_name": fields.get("Model name", "").strip(), "cores": os.cpu_count(),
            "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}


def compressed_bytes(image: str, engine: list[str]) -> int:
    """What a registry stores: the image's layers gzip-compressed (podman save, gzip -6)."""
    command = f"{shlex.join([*engine, 'save', image])} | gzip -6 | wc -c"
    return int(subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True,
                              check=True).stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=REPO / "bench" / "results" / "image-cpu.json")
    parser.add_argument("--notes", help="how the figures were taken")
    args = parser.parse_args()
    out = args.out.resolve()
    build = json.loads((REPO / "build" / "image" / "last.json").read_text())
    tests = json.loads((REPO / "build" / "image" / "test-figures.json").read_text())
    sys.path.insert(0, str(REPO))
    from tests.support.containers import engine

    build["compressed_bytes"] = compressed_bytes(build["image"], engine())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=False).stdout.strip()
    version = subprocess.run([*engine(), "--version"], capture_output=True, text=True, check=False).stdout.strip()
    result = {"recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "machine": {"cpu": cpu(), "kernel": platform.release(), "engine": version},
              "commands": ["make image", "make test-image"], "build": build, "tests": tests}
    if args.notes:
        result["notes"] = args.notes
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {os.path.relpath(out, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
