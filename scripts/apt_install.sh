#!/usr/bin/env bash
# Install Debian/Ubuntu packages when a command is missing: scripts/apt_install.sh COMMAND PACKAGE...
# Uses sudo when not root; says what to run when apt-get is not there or fails.
set -euo pipefail
command="$1"; shift
command -v "$command" >/dev/null 2>&1 && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: '$command' is missing; install $* with your package manager" >&2
  exit 1
fi
sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
echo "installing $* (for '$command') ..." >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
  || { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } \
  || { echo "error: could not install $*; install it and run again" >&2; exit 1; }
