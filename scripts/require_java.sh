#!/usr/bin/env bash
# TorchServe's frontend is a Java program: require Java 17 or newer, installing Debian's Java 17
# runtime when java is missing.
set -euo pipefail
bash "$(dirname "$0")/apt_install.sh" java openjdk-17-jre-headless
version=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\)\(\.[0-9]*\)*.*/\1/p' | head -n 1)
if [[ "$version" == "1" ]]; then version=8; fi  # "1.8.0" is Java 8
if [[ -z "$version" || "$version" -lt 17 ]]; then
  echo "error: Java 17 or newer is required by TorchServe; found: $(java -version 2>&1 | head -n 1)" >&2
  exit 1
fi
