#!/usr/bin/env bash
# What scripts/gpu_run.sh needs on a GPU machine without network, made here in build/gpu/ (which
# git ignores, so name both folders when copying; docs/gpu.md):
#
#   scripts/gpu_travel.sh               (make gpu-travel)
#
#   build/gpu/handler-wheels/    orjson for CPython $PYTHON_VERSION on x86-64 Linux (the one import of
#                                the handler such a machine lacks), and transformers and
#                                sentence-transformers at this environment's versions (pure Python:
#                                the native ports and the model makers need these, not a GPU image's)
#   build/gpu/families/          every family of bench/gpu_families.py, made and staged (2.5 MiB)
#   build/gpu/minilm-fp16.tar.xz all-MiniLM-L6-v2 with float16 weights, packed (37 MiB; the folder is
#                                44 MiB, 87 in float32); scripts/gpu_run.sh unpacks it there
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
# The installed versions, so the GPU machine runs what the tests here ran.
PINNED=$("$PY" -c 'import transformers, sentence_transformers as st
print(f"transformers=={transformers.__version__} sentence-transformers=={st.__version__}")')
# shellcheck disable=SC2086  # two requirements
"$PY" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check -d "$DIR/handler-wheels" $PINNED \
    || die "pip download $PINNED failed"

rm -rf "$DIR/families" "$DIR/families.partial"
"$PY" -m bench.gpu_families --prepare "$DIR/families.partial" > /dev/null || die "making the families failed"
mv "$DIR/families.partial" "$DIR/families"

# Written beside the target and moved into place, so that an interrupted run leaves no half copy
# that a later run would take for a whole one.
if [[ ! -f "$DIR/minilm-fp16/model.safetensors" ]]; then
    rm -rf "$DIR/minilm-fp16.partial"
    "$PY" -m bench.gpu --write-fp16-copy "$DIR/minilm-fp16.partial" || die "the fp16 copy failed"
    rm -rf "$DIR/minilm-fp16"
    mv "$DIR/minilm-fp16.partial" "$DIR/minilm-fp16"
fi
if [[ ! -f $DIR/minilm-fp16.tar.xz || -n $(find "$DIR/minilm-fp16" -newer "$DIR/minilm-fp16.tar.xz" -print -quit) ]]; then
    "$PY" scripts/pack_xz.py "$DIR/minilm-fp16.tar.xz" "$DIR" minilm-fp16 --weights || die "packing the model failed"
fi

CARRY=("$DIR/handler-wheels" "$DIR/families" "$DIR/minilm-fp16.tar.xz")
ls -1 "$DIR/handler-wheels" >&2
du -sh "${CARRY[@]}" >&2
size=$(du -sm -c "${CARRY[@]}" | tail -n 1 | cut -f 1)
(( size <= LIMIT_MIB )) || die "${CARRY[*]} take ${size} MiB, over ${LIMIT_MIB}"
echo "carry ${CARRY[*]} (${size} MiB) with the repository" >&2
