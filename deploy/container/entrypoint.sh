#!/usr/bin/env bash
# Container entry point: TorchServe in the foreground, stopped in order on SIGTERM.
#   (no arguments)          serve $EMBEDSERVE_CONFIG (the image's config.properties)
#   --flag ...              the same, with extra torchserve flags (e.g. --disable-token-auth)
#   torchserve --start ...  run that server command (KServe's TorchServe runtime passes one)
#   anything else           run it as given (a shell, python -m embedserve.scripts.probe)
set -euo pipefail

if [[ $# -eq 0 || "$1" == -* ]]; then
  set -- torchserve --start --ts-config "${EMBEDSERVE_CONFIG:-/opt/embedserve/config/config.properties}" "$@"
elif [[ "$1" != torchserve ]]; then
  exec "$@"
fi

# `torchserve --start` launches the JVM and returns at once; --foreground keeps the launcher
# attached so that this script lives as long as the server. --ncs: no config snapshots (files
# TorchServe would otherwise write under its log folder at every change).
"$@" --foreground --ncs &
launcher=$!

# Kubernetes stops a container with SIGTERM. `torchserve --stop` terminates the frontend, which
# stops its workers and exits; --foreground makes it wait for that (up to 60 s).
stopping=""
trap 'stopping=1; torchserve --stop --foreground >/dev/null 2>&1 || true' TERM INT

status=0
wait "$launcher" || status=$?
if [[ -n "$stopping" ]]; then
  # The signal cut `wait` short (status 128 + signal): report the launcher's own exit instead.
  status=0
  wait "$launcher" || status=$?
fi
exit "$status"
