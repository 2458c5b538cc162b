#!/usr/bin/env bash
# make image: build the CPU image from Debian's packages and PyPI only.
#   IMAGE=embedserve:0.1.0      the tag
#   BASE_IMAGE=...              a base of your own; by default python:3.11-slim-bookworm when a
#                               registry has it, else one built here with mmdebstrap (build_base.sh)
#   REBUILD_BASE=1              rebuild the mmdebstrap base even when it exists
#   NO_CACHE=1                  no layer of an earlier build reused (with REBUILD_BASE=1: from nothing)
# The wheels (torch's CPU wheel among them) are built on the host into a wheelhouse that the
# build installs with --no-index, so the image never sees PyPI's CUDA build. An image that
# carries CUDA libraries or Python bytecode caches anyway is refused and removed. Prints the size;
# writes build/image/last.json.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
source scripts/image/engine.sh
image="${IMAGE:-embedserve:0.1.0}"
python="${PYTHON:-$repo/.venv/bin/python}"
work=build/image
context=$work/context
start=$(date +%s)

# A full container storage fails a build deep in a layer's commit ("io: read/write on closed
# pipe"); say so first. The image and its build stages take about 3 GB.
storage=$(engine info --format '{{.Store.GraphRoot}}' 2>/dev/null || true)
if [[ -n "$storage" && -d "$storage" ]]; then
  free_kb=$(df -Pk "$storage" | awk 'NR == 2 {print $4}')
  if (( free_kb < 4 * 1024 * 1024 )); then
    echo "error: $((free_kb / 1024)) MB free where $ENGINE stores images ($storage); the build needs about 4 GB:" \
         "remove images no longer used ($ENGINE image prune)" >&2
    exit 1
  fi
fi

base="${BASE_IMAGE:-}"
base_built=false
if [[ -z "$base" ]]; then
  # The public base when it is here or can be pulled; a machine without a registry builds its own.
  if engine image inspect python:3.11-slim-bookworm >/dev/null 2>&1 \
     || timeout 60 "$ENGINE" $ENGINE_FLAGS pull -q docker.io/library/python:3.11-slim-bookworm >/dev/null 2>&1; then
    base=python:3.11-slim-bookworm
  else
    base=localhost/embedserve-base:bookworm
    if [[ -n "${REBUILD_BASE:-}" ]] || ! engine image inspect "$base" >/dev/null 2>&1; then
      echo "no registry reachable: building the base from Debian's packages (mmdebstrap) ..." >&2
      bash scripts/image/build_base.sh "$ENGINE" "$base"
      base_built=true
    fi
  fi
fi
base_done=$(date +%s)

# The build context: only what the Dockerfile copies, the image's own .mar (one torch thread per
# worker: a container's CPU limit is not the host's core count) and the wheelhouse.
rm -rf "$context"
mkdir -p "$context/deploy/container/wheelhouse" "$context/model_store"
cp setup.cfg pyproject.toml README.md "$context/"
cp -r embedserve "$context/"
find "$context/embedserve" -name __pycache__ -prune -exec rm -rf {} +
cp deploy/container/Dockerfile deploy/container/Dockerfile.dockerignore deploy/container/config.properties \
   deploy/container/entrypoint.sh "$context/deploy/container/"
cp config.properties "$work/mar.properties"  # build_mar.sh rewrites the config it is given: not the repository's
echo "building the .mar (./build_mar.sh --set cpu_threads=1) ..." >&2
./build_mar.sh --set cpu_threads=1 --export-path "$context/model_store" --config "$work/mar.properties" \
  > "$work/build_mar.log" 2>&1 || { tail -n 30 "$work/build_mar.log" >&2; exit 1; }
mar_done=$(date +%s)

echo "building the wheelhouse (torch==2.13.0 CPU and the project's dependencies) ..." >&2
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "error: $python is not Python 3.11, the image's Python: its wheels would not fit" >&2; exit 1
fi
# async-timeout: redis needs it below Python 3.11.3 (Debian 12's is 3.11.2), and pip resolves
# markers for the host's Python, which may be newer.
"$python" -m pip wheel -q --wheel-dir "$context/deploy/container/wheelhouse" torch==2.13.0 ".[openvino]" \
  setuptools wheel "async-timeout>=4.0.3" 2> >(grep -v "^WARNING: Location" >&2)
# A CPU build carries no CUDA: PyPI's torch pulls nvidia-* wheels, the CPU wheel none.
cuda_wheels=$(cd "$context/deploy/container/wheelhouse" && ls | grep -iE '^(nvidia|cuda|triton)' || true)
if [[ -n "$cuda_wheels" ]] || ! ls "$context/deploy/container/wheelhouse"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  echo "error: the wheelhouse is not CPU-only (torch is not the +cpu wheel, or CUDA wheels: $cuda_wheels); refusing to build" >&2
  exit 1
fi
wheels_done=$(date +%s)

echo "building $image on $base with $ENGINE ..." >&2
# The image this tag names now: once the new build takes the tag it would stay behind untagged,
# 1.3 GB a build, until the engine's storage fills (removed below when nothing else names it).
replaced=$(engine image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
# Podman needs the ignore file named; docker reads Dockerfile.dockerignore beside the Dockerfile.
ignore=(); [[ "$ENGINE" == podman ]] && ignore=(--ignorefile "$context/deploy/container/Dockerfile.dockerignore")
cache=(); [[ -n "${NO_CACHE:-}" ]] && cache=(--no-cache)
engine build $RUN_FLAGS --network=host "${ignore[@]}" "${cache[@]}" \
  -f "$context/deploy/container/Dockerfile" --build-arg "BASE_IMAGE=$base" -t "$image" "$context" > "$work/build.log" 2>&1 \
  || { tail -n 40 "$work/build.log" >&2; exit 1; }
built=$(date +%s)

# Refuse an image with CUDA libraries on a CPU build, whatever brought them in.
found=$(engine run $RUN_FLAGS --rm --network=none --entrypoint sh "$image" -c \
  'find / -xdev \( -name "libcudart*" -o -name "libcublas*" -o -name "libcudnn*" -o -name "libnccl*" \) 2>/dev/null | head -n 5;
   python -c "import torch; print(\"torch.version.cuda=\" + torch.version.cuda) if torch.version.cuda else None"')
if [[ -n "$found" ]]; then
  engine rmi "$image" >/dev/null
  echo "error: the CPU image carries CUDA; removed it:" >&2; echo "$found" >&2; exit 1
fi
# ... or with Python bytecode caches (a base or a package that compiled them at install time).
found=$(engine run $RUN_FLAGS --rm --network=none --user 0 --entrypoint sh "$image" -c \
  'find / -xdev -name "*.pyc" | head -n 5')
if [[ -n "$found" ]]; then
  engine rmi "$image" >/dev/null
  echo "error: the image carries Python bytecode caches; removed it:" >&2; echo "$found" >&2; exit 1
fi

new_id=$(engine image inspect --format '{{.Id}}' "$image")
if [[ -n "$replaced" && "$replaced" != "$new_id" ]] \
   && [[ -z "$(engine image inspect --format '{{join .RepoTags ""}}' "$replaced" 2>/dev/null)" ]]; then
  engine rmi "$replaced" >/dev/null 2>&1 || true  # a container still running it keeps it
fi
size=$(engine image inspect --format '{{.Size}}' "$image")
cat > "$work/last.json" <<JSON
{"image": "$image", "base": "$base", "engine": "$ENGINE", "size_bytes": $size,
 "base_built": $base_built, "layer_cache": $([[ -n "${NO_CACHE:-}" ]] && echo false || echo true),
 "seconds": {"base": $((base_done - start)), "mar": $((mar_done - base_done)), "wheels": $((wheels_done - mar_done)),
             "image": $((built - wheels_done)), "total": $(( $(date +%s) - start ))}}
JSON
echo "built $image on $base in $(( $(date +%s) - start )) s: $((size / 1000000)) MB uncompressed, no CUDA libraries, no bytecode caches"
