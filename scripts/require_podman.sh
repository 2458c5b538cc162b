#!/usr/bin/env bash
# The image's build and tests (make image, make test-image): podman with runc, mmdebstrap for a
# base where no registry is reachable, and nginx for the replica test; installed with apt when missing.
set -euo pipefail
here="$(dirname "$0")"
bash "$here/apt_install.sh" podman podman
bash "$here/apt_install.sh" runc runc
bash "$here/apt_install.sh" mmdebstrap mmdebstrap
if ! command -v nginx >/dev/null 2>&1 && [[ ! -x /usr/sbin/nginx ]]; then
  bash "$here/apt_install.sh" nginx nginx
fi
