# Sourced by the image scripts: pick the container engine and the flags this machine needs.
#   ENGINE: podman, or docker where a daemon answers (override: EMBEDSERVE_ENGINE)
#   ENGINE_FLAGS: global flags (override: EMBEDSERVE_ENGINE_FLAGS). With podman, runc and
#     cgroupfs: crun refuses hybrid cgroups ("cgroups in hybrid mode not supported").
#   RUN_FLAGS: flags for run and build. The default rlimits are refused in some sandboxes
#     ("setrlimit ... Operation not permitted"); lowered ones are not, and TorchServe needs no more.
ENGINE="${EMBEDSERVE_ENGINE:-}"
if [[ -z "$ENGINE" ]]; then
  if command -v podman >/dev/null 2>&1; then ENGINE=podman
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then ENGINE=docker
  else echo "error: no container engine: install podman (apt-get install podman runc) or start docker" >&2; exit 1
  fi
fi
if [[ -z "${EMBEDSERVE_ENGINE_FLAGS+set}" && "$ENGINE" == podman ]] && command -v runc >/dev/null 2>&1; then
  ENGINE_FLAGS="--runtime runc --cgroup-manager=cgroupfs"
else
  ENGINE_FLAGS="${EMBEDSERVE_ENGINE_FLAGS:-}"
fi
RUN_FLAGS="${EMBEDSERVE_RUN_FLAGS---ulimit nofile=1024:1024 --ulimit nproc=1024:1024}"
# shellcheck disable=SC2086
engine() { "$ENGINE" $ENGINE_FLAGS "$@"; }
