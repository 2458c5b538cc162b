#!/usr/bin/env bash
# Build the image's base from Debian's packages alone, for machines that reach no container
# registry: Debian 12 with its Python 3.11, the Java 17 runtime, tini and curl.
#   scripts/image/build_base.sh ENGINE NAME     (ENGINE: podman or docker)
# The Dockerfile installs nothing more into it from apt: it finds java and tini already there.
set -euo pipefail
engine="$1"; name="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# bookworm, bookworm-updates and bookworm-security: the same suites the python image is built on.
sources="deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main"
# python-is-python3: the readiness probe runs `python -m ...`; passwd: useradd.
# Documentation, man pages and locales are left out: nothing in the image reads them (the
# Java package's update-alternatives still needs the man1 folder to exist).
mmdebstrap --quiet --variant=essential --format=tar \
  --setup-hook='mkdir -p "$1/usr/share/man/man1"' \
  --include=python3,python3-pip,python-is-python3,openjdk-17-jre-headless,tini,curl,ca-certificates,passwd \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  bookworm "$work/rootfs.tar" - <<<"$sources"
"$engine" import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$work/rootfs.tar" "$name" >/dev/null
echo "base image $name built with mmdebstrap (Debian bookworm)" >&2
