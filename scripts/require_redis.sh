#!/usr/bin/env bash
# The cache tests run against a real redis-server, which they start on a free loopback port.
set -euo pipefail
bash "$(dirname "$0")/apt_install.sh" redis-server redis-server
