#!/usr/bin/env bash
# What scripts/gpu_run.sh needs on a GPU machine without network, made here in build/gpu/ (which
# git ignores, so name both folders when copying; docs/gpu.md):
#
#   scripts/gpu_travel.sh               (make gpu-travel)
#
#   build/gpu/handler-wheels/   orjson for CPython $PYTHON_VERSION on x86-64 Linux: the one import of
#                               the handler such a machine lacks
#   build/gpu/minilm-fp16/      all-MiniLM-L6-v2 with float16 weights (44 MiB; 87 in float32)
#
# Together under 60 MiB, so they travel in one piece beside the repository. Needs no JDK; needs the
# project's environment (make's .venv) and pip with access to the package index.
set -uo pipefail

cd "$(dirname "$0")/.."
DIR=build/gpu
PYTHON_VERSION=${PYTHON_VERSION:-3.12}  # the GPU machine's python3
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
LIMIT_MIB=60

die() {
    echo "gpu-travel: $*" >&2
    exit 1
}

# orjson at the range setup.cfg asks for, as a binary wheel for the GPU machine's Python (not this
# one's: the versions may differ).
ORJSON=$(grep -oP '^\s*\Korjson[<>=!~].*' setup.cfg | head -n 1)
[[ -n "$ORJSON" ]] || die "no orjson requirement in setup.cfg"
rm -rf "$DIR/handler-wheels"
mkdir -p "$DIR/handler-wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
    --python-version "$PYTHON_VERSION" --implementation cp --abi "cp${PYTHON_VERSION/./}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR/handler-wheels" "$ORJSON" || die "pip download $ORJSON failed"

# Written beside the target and moved into place, so that an interrupted run leaves no half copy
# that a later run would take for a whole one.
if [[ ! -f "$DIR/minilm-fp16/model.safetensors" ]]; then
    rm -rf "$DIR/minilm-fp16.partial"
    "$PY" -m bench.gpu --write-fp16-copy "$DIR/minilm-fp16.partial" || die "the fp16 copy failed"
    rm -rf "$DIR/minilm-fp16"
    mv "$DIR/minilm-fp16.partial" "$DIR/minilm-fp16"
fi

ls -1 "$DIR/handler-wheels" >&2
du -sh "$DIR/handler-wheels" "$DIR/minilm-fp16" >&2
size=$(du -sm -c "$DIR/handler-wheels" "$DIR/minilm-fp16" | tail -n 1 | cut -f 1)
(( size <= LIMIT_MIB )) || die "build/gpu/handler-wheels and minilm-fp16 take ${size} MiB, over ${LIMIT_MIB}"
echo "carry build/gpu/handler-wheels and build/gpu/minilm-fp16 (${size} MiB) with the repository" >&2
