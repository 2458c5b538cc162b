#!/usr/bin/env bash
# Create the virtual environment and install the project into it.
#   scripts/bootstrap.sh PYTHON VENV [EXTRAS]
set -euo pipefail
python="${1:-python3}"; venv="${2:-.venv}"; extras="${3:-}"

if ! command -v "$python" >/dev/null 2>&1; then
  echo "error: $python not found; Python 3.10 or newer is required (set PYTHON=/path/to/python3)" >&2
  exit 1
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "error: Python 3.10 or newer is required; $python is $("$python" -V 2>&1)" >&2
  exit 1
fi
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv" || { echo "error: could not create $venv (on Debian/Ubuntu: apt install python3-venv)" >&2; exit 1; }
fi
target="."
[[ -n "$extras" ]] && target=".[$extras]"
echo "installing $target into $venv (torch is pinned to 2.13.0) ..."
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$target"
