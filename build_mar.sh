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
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m embedserve.archive.build "$@"
