#!/usr/bin/env bash
# What a GPU machine with Python, PyTorch and CUDA but no Java, no network and no TorchServe needs
# to serve this package (docs/gpu.md says how to carry and use it):
#
#   scripts/gpu_bundle.sh [DIR]          DIR defaults to build/gpu/bundle (ignored by git)
#
#   DIR/jre/                a minimal Java runtime made with jlink: JAVA_HOME for `torchserve`
#   DIR/torchserve-wheels/  torchserve and torch-model-archiver, at the versions setup.cfg pins
#   DIR/handler-wheels/     orjson (the handler's one dependency such a machine lacks) and
#                           enum-compat (torch-model-archiver's), for CPython $PYTHON_VERSION
#
# Needs a JDK 17+ (jlink) and pip with access to the package index.
set -euo pipefail

cd "$(dirname "$0")/.."
DIR=${1:-build/gpu/bundle}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}  # the GPU machine's python3
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
JLINK=${JLINK:-$(command -v jlink || true)}

# The JDK modules TorchServe's frontend uses: `jdeps --print-module-deps --ignore-missing-deps` over
# the classes of ts/frontend/model-server.jar (its bundled module-info files removed), plus
# jdk.management (the JVM's own MXBeans) and jdk.crypto.ec (TLS, should HTTPS be configured).
# java.desktop looks odd on a server; log4j and snakeyaml read properties through java.beans, in it.
MODULES=java.base,java.compiler,java.desktop,java.management.rmi,java.naming,java.prefs,java.scripting,java.sql
MODULES+=,jdk.sctp,jdk.unsupported,jdk.management,jdk.crypto.ec

if [[ -z "$JLINK" ]]; then
    echo "jlink not found: install a JDK 17+ (Debian: openjdk-17-jdk-headless) or set JLINK" >&2
    exit 1
fi
java_major=$("$JLINK" --version | cut -d. -f1)
if (( java_major < 17 )); then
    echo "$JLINK is Java $java_major; TorchServe needs 17+" >&2
    exit 1
fi
pin() {  # the version setup.cfg pins for a package
    grep -oP "^\s*$1==\K[0-9.]+" setup.cfg
}

rm -rf "$DIR/jre" "$DIR/torchserve-wheels" "$DIR/handler-wheels"  # only what this script makes
mkdir -p "$DIR"
echo "jlink: $MODULES" >&2
"$JLINK" --add-modules "$MODULES" --output "$DIR/jre" \
    --compress=2 --strip-debug --no-header-files --no-man-pages
"$DIR/jre/bin/java" -version

download() {  # DEST SPEC...: wheels for the GPU machine's Python on x86-64 Linux, no dependencies
    local dest=$1
    shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
        --python-version "$PYTHON_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DIR/$dest" "$@"
}
download torchserve-wheels "torchserve==$(pin torchserve)" "torch-model-archiver==$(pin torch-model-archiver)"
download handler-wheels "orjson>=3.9" enum-compat

echo >&2
du -shc "$DIR"/* >&2
ls -1 "$DIR"/*-wheels/ >&2
