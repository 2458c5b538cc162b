#!/usr/bin/env bash
# The cache tests run against a real redis-server, which they start on a free loopback port.
set -euo pipefail
if ! command -v redis-server >/dev/null 2>&1; then
  echo "error: the tests need redis-server (Debian/Ubuntu: apt install redis-server); .ci/run installs it" >&2
  exit 1
fi
