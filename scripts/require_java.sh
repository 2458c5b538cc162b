#!/usr/bin/env bash
# TorchServe's frontend is a Java program: require Java 17 or newer.
set -euo pipefail
if ! command -v java >/dev/null 2>&1; then
  echo "error: Java 17 or newer is required by TorchServe and 'java' is not on PATH (Debian/Ubuntu: apt install openjdk-17-jre-headless)" >&2
  exit 1
fi
version=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\)\(\.[0-9]*\)*.*/\1/p' | head -n 1)
if [[ "$version" == "1" ]]; then version=8; fi  # "1.8.0" is Java 8
if [[ -z "$version" || "$version" -lt 17 ]]; then
  echo "error: Java 17 or newer is required by TorchServe; found: $(java -version 2>&1 | head -n 1)" >&2
  exit 1
fi
