#!/usr/bin/env bash
# Build a .mar from an embedding model and register it in config.properties.
#   ./build_mar.sh                      # the default model, all-MiniLM-L6-v2
#   ./build_mar.sh --model PATH_OR_ID   # any Hugging Face model folder (or hub id when online)
#   ./build_mar.sh --help               # every option
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python="python3"; fi
fi
# The build needs the project's environment; on a fresh clone there is none yet.
has_environment() {
  "$1" -c 'import importlib.util, sys
sys.exit(not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "yaml", "ts")))' >/dev/null 2>&1
}
if ! has_environment "$python"; then
  if [[ -z "${PYTHON:-}" && ! -x "$repo/.venv/bin/python" ]]; then
    echo "build_mar.sh: no environment yet; setting up .venv first (1-2 minutes, as make serve does)" >&2
    make -C "$repo" --no-print-directory .venv/.installed >&2
    python="$repo/.venv/bin/python"
  else
    echo "build_mar.sh: $python lacks the project's packages (torch, transformers, torchserve); run 'make mar', which sets up .venv, or set PYTHON to a Python with the project installed" >&2
    exit 2
  fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m embedserve.archive.build "$@"
