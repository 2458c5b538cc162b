#!/usr/bin/env bash
# Build the image's base from Debian's packages alone, for machines that reach no container
# registry: Debian 12 with its Python 3.11, tini, curl and apt, no Java and no bytecode caches.
#   scripts/image/build_base.sh ENGINE NAME     (ENGINE: podman or docker)
# The Dockerfile installs nothing more into it from apt: it finds python, tini and curl there.
# Its Java runtime stage installs Debian's JDK with apt to jlink a runtime from it (apt and the
# archive keyring are here for that stage; the final image carries the jlinked runtime only).
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
# JDK package's update-alternatives, in the Dockerfile's Java stage, still needs the man1 folder).
# /usr merged with symlinks as debootstrap (and Debian's own images) do: the usrmerge package
# that would otherwise do it brings perl (46 MB) along.
merged_usr=(--include=usrmerge)
hooks=/usr/share/mmdebstrap/hooks/merged-usr
[[ -d "$hooks" ]] && merged_usr=(--hook-dir="$hooks")
# No Python bytecode caches: Debian's packages compile theirs when they are installed (24 MB here).
mmdebstrap --quiet --variant=essential --format=tar "${merged_usr[@]}" \
  --setup-hook='mkdir -p "$1/usr/share/man/man1"' \
  --include=python3,python3-pip,python-is-python3,tini,curl,ca-certificates,passwd,apt,debian-archive-keyring \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='find "$1/usr" -name __pycache__ -prune -exec rm -rf {} +' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  bookworm "$work/rootfs.tar" - <<<"$sources"
"$engine" import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$work/rootfs.tar" "$name" >/dev/null
echo "base image $name built with mmdebstrap (Debian bookworm)" >&2
