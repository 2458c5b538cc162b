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

# The config the server runs with: the image's, or the one a command line names (KServe's).
config="${EMBEDSERVE_CONFIG:-/opt/embedserve/config/config.properties}"
previous=""
for arg in "$@"; do
  case "$arg" in --ts-config=*) config="${arg#--ts-config=}" ;; esac
  if [[ "$previous" == --ts-config ]]; then config="$arg"; fi
  previous="$arg"
done

# Kubernetes stops a container with SIGTERM. `torchserve --stop` closes the connections of
# requests still queued or in a batch, unanswered: first wait until none is queued (management
# API) and no worker runs a batch (the handler's busy marks in TMPDIR), seen twice in a row, for
# at most DRAIN_S (default 25 s; the Deployment's grace period leaves room for it and the stop).
# Then stop the frontend, which stops its workers and exits; --foreground waits for that.
drain() {
  python - "$config" "${DRAIN_S:-25}" <<'PY' || true
import json, sys, tempfile, time
from pathlib import Path
import requests
from embedserve.archive.ts_config import read_properties
from embedserve.handler.worker.busy import any_busy

properties = read_properties(Path(sys.argv[1]))
management = properties.get("management_address", "http://127.0.0.1:8081").rstrip("/")
models = json.loads(properties.get("models") or "{}")

def pending() -> int:
    try:  # no key file: token authorization is off
        headers = {"Authorization": "Bearer " + json.loads(Path("key_file.json").read_text())["management"]["key"]}
    except (OSError, ValueError, KeyError):
        headers = {}
    total = 0
    for name in models:
        try:
            described = requests.get(f"{management}/models/{name}", headers=headers, timeout=5).json()
        except (requests.RequestException, ValueError):
            return 0  # the frontend is gone or not answering: nothing left to wait for
        total += sum(int((e.get("jobQueueStatus") or {}).get("pendingRequests", 0)) for e in described
                     if isinstance(e, dict))
    return total

deadline, quiet = time.monotonic() + float(sys.argv[2]), 0
while quiet < 2 and time.monotonic() < deadline:
    quiet = quiet + 1 if pending() == 0 and not any_busy(Path(tempfile.gettempdir())) else 0
    time.sleep(0.25)
PY
}
stopping=""
trap 'stopping=1; drain; torchserve --stop --foreground >/dev/null 2>&1 || true' TERM INT

status=0
wait "$launcher" || status=$?
if [[ -n "$stopping" ]]; then
  # The signal cut `wait` short (status 128 + signal): report the launcher's own exit instead.
  status=0
  wait "$launcher" || status=$?
fi
exit "$status"
