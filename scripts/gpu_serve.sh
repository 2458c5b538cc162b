#!/usr/bin/env bash
# End to end through TorchServe on a GPU machine without Java, network or TorchServe
# (docs/gpu.md, "TorchServe there"):
#
#   scripts/gpu_serve.sh OUTDIR            unpack, install, build, serve, load, stop (220 s budget)
#   scripts/gpu_serve.sh --stage-only      unpack and install only (the first of two calls)
#
# It needs what scripts/gpu_bundle.sh makes in build/gpu/: runtime.tar.xz (a Java runtime and the
# TorchServe wheels) and minilm-fp16.tar.xz (all-MiniLM-L6-v2 in float16). Each is unpacked into
# the stage folder (/tmp/embedserve-gpu), where a later call finds it when it is not carried again.
# The steps, each under a time limit, all within one budget:
#
#   stage      unpack the archives (or find them unpacked by an earlier call); MISSING names what
#              is neither carried nor staged
#   install    the wheels into the stage's site folder (pip --no-index --target), put on
#              PYTHONPATH and PATH; JAVA_HOME is the staged runtime; `java -version` runs
#   build      ./build_mar.sh on the model with the GPU build's settings (as `make serve` builds
#              on a GPU: float16 on CUDA, two workers, graphs of packed passes), into a config of its own on free ports
#   serve      python -m bench.gpu_serve: start TorchServe, then each load shape (1, 64 and 256
#              clients of one-text requests, 256 clients of 32-text requests) with the GPU's
#              utilisation and memory sampled; then `embedserve batch` of GPU_SERVE_BATCH_TEXTS
#              texts; then, with GPU_SERVE_WORKERS, each worker count in turn with the sweep
#              shapes and the GPU memory per worker; then stop it
#   stop       always, beyond the budget (30 s at most; a second when the serve step stopped the
#              server): stop the server whatever happened, and kill what is left of it
#
# It writes OUTDIR/serving.json (texts/s, p50/p95/p99, errors, GPU utilisation and memory and CPU
# use per shape, versions, the start-up time, each step's exit status and time, and the first
# step that failed), OUTDIR/gpu_serve.log (everything printed), OUTDIR/steps.tsv, and the last
# lines of the server's ts_log.log and model_log.log. Exit status 0
# when every step passed and no request failed.
#
# Without CUDA it runs the same steps in CPU mode, with the installed Java and $PY's TorchServe
# unless a runtime archive is there: the dry run. Settings, from the environment:
#
#   GPU_SERVE_SECONDS=220           the whole run's budget (an H200 took 22 s to build, 35 s to be ready)
#   GPU_SERVE_DEVICE=auto           auto, cuda or cpu
#   GPU_SERVE_STAGE=/tmp/embedserve-gpu   where the archives are unpacked
#   GPU_SERVE_RUNTIME=build/gpu/runtime.tar.xz      `installed`: Java and TorchServe as installed
#   GPU_SERVE_MODEL=build/gpu/minilm-fp16.tar.xz    an archive of one model folder, or a folder
#   GPU_SERVE_SHAPES="1x1 64x1 256x1 64x32 256x32"  clients x texts per request
#   GPU_SERVE_WORKERS=""            worker counts to scale to after the shapes (e.g. "12 4 2": up by the fewest new workers first), each
#                                   running GPU_SERVE_SWEEP_SHAPES (default "256x1 64x32") again
#   GPU_SERVE_BATCH_TEXTS=100000    after the shapes, `embedserve batch` of this many texts against the
#                                   server (2000 in CPU mode; 0: none)
#   GPU_SERVE_MPS=0                 1: the server's workers share the GPU through CUDA MPS (its control
#                                   daemon started for the run, stopped after; serving.json's `mps` says
#                                   whether it ran, or why not)
#   GPU_SERVE_SHAPE_SECONDS=12      measured seconds per shape, at most (less when the budget is short)
#   GPU_SERVE_WARMUP_SECONDS=4      uncounted seconds before each shape
#   GPU_SERVE_PROCESSES=0           load processes at most (0: half the CPUs; 32 clients each)
#   GPU_SERVE_BUILD_ARGS="..."      build_mar.sh's arguments besides the model (default: by device)
#   PY=python3                      the interpreter that holds PyTorch
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
STAGE_ONLY=0
if [[ ${1:-} == --stage-only ]]; then
    STAGE_ONLY=1
    OUT=${2:-$(mktemp -d /tmp/gpu-serve-out.XXXXXX)}
else
    OUT=${1:?usage: scripts/gpu_serve.sh OUTDIR | --stage-only [OUTDIR]}
fi
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_SERVE_SECONDS:-220}
DEVICE=${GPU_SERVE_DEVICE:-auto}
STAGE=${GPU_SERVE_STAGE:-/tmp/embedserve-gpu}
RUNTIME=${GPU_SERVE_RUNTIME:-build/gpu/runtime.tar.xz}
MODEL_SOURCE=${GPU_SERVE_MODEL:-build/gpu/minilm-fp16.tar.xz}
PY=${PY:-python3}
STOP_LIMIT=30  # the last step's limit, beyond the budget (seconds when the serve step stopped the server)
SERVE_MIN=60   # what the serve step needs at least (start-up and a short shape)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_RETRIES=0 PIP_TIMEOUT=5 PIP_NO_INPUT=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

STEP_KILL_AFTER=30  # a step's SIGTERM, then SIGKILL this long after
# shellcheck source=scripts/steps.sh
source scripts/steps.sh

unpack() {  # ARCHIVE DEST: an xz tar into DEST, whole or not at all
    rm -rf "$2.partial" && mkdir -p "$2.partial" || return 1
    timeout 120 "$PY" - "$1" "$2.partial" <<'EOF' || return 1
import sys, tarfile, time
began = time.monotonic()
with tarfile.open(sys.argv[1], "r:xz") as tar:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(sys.argv[2], filter="data")
    else:
        tar.extractall(sys.argv[2])
print(f"unpacked {sys.argv[1]} in {time.monotonic() - began:.1f} s")
EOF
    rm -rf "$2" && mv "$2.partial" "$2"
}

stage() {  # the archives carried, unpacked; or what an earlier call unpacked
    local missing=()
    mkdir -p "$STAGE" || return 1
    if [[ $RUNTIME == installed ]]; then
        echo "runtime: the installed Java ($(command -v java || echo none)) and $PY's TorchServe"
    elif [[ -f $RUNTIME ]]; then
        unpack "$RUNTIME" "$STAGE/runtime" || missing+=("$RUNTIME (could not be unpacked)")
    elif [[ -x $STAGE/runtime/jre/bin/java ]]; then
        echo "runtime: not carried; using $STAGE/runtime, staged by an earlier call"
    else
        missing+=("$RUNTIME (carry build/gpu/runtime.tar.xz, or stage it first: scripts/gpu_serve.sh --stage-only)")
    fi
    if ((STAGE_ONLY)); then
        :
    elif [[ -d $MODEL_SOURCE ]]; then
        MODEL=$MODEL_SOURCE
    elif [[ -f $MODEL_SOURCE ]]; then
        unpack "$MODEL_SOURCE" "$STAGE/model" || missing+=("$MODEL_SOURCE (could not be unpacked)")
    elif ! compgen -G "$STAGE/model/*/config.json" > /dev/null; then
        missing+=("$MODEL_SOURCE (carry build/gpu/minilm-fp16.tar.xz)")
    else
        echo "model: not carried; using $STAGE/model, staged by an earlier call"
    fi
    if [[ -z ${MODEL:-} ]] && ! ((STAGE_ONLY)); then
        MODEL=$(dirname "$(compgen -G "$STAGE/model/*/config.json" | head -n 1)")
    fi
    if ((${#missing[@]})); then
        printf 'MISSING: %s\n' "${missing[@]}"
        return 1
    fi
    du -sh "$STAGE"/* 2> /dev/null || true
}

install() {  # the staged wheels into a site folder of their own; JAVA_HOME, PATH and PYTHONPATH set
    local site=$STAGE/site wheels=()
    if [[ $RUNTIME != installed ]]; then
        export JAVA_HOME=$STAGE/runtime/jre
        wheels=("$STAGE"/runtime/wheels/torch*.whl)
        # orjson only where missing (its wheel is for the GPU machine's Python).
        "$PY" -c 'import orjson' 2> /dev/null || wheels+=("$STAGE"/runtime/wheels/orjson-*.whl)
        rm -rf "$site"
        if ! timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"; then
            # A wheel is a zip laid out as installed: without pip, unpacking it is the install, and
            # the launchers (torchserve, torch-model-archiver) are written from its entry points.
            echo "pip install failed: unpacking the wheels into $site"
            rm -rf "$site"
            timeout 60 "$PY" - "$site" "${wheels[@]}" <<'EOF' || return 1
import configparser, sys, zipfile
from pathlib import Path
site = Path(sys.argv[1])
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(site)
(site / "bin").mkdir(exist_ok=True)
for points in site.glob("*.dist-info/entry_points.txt"):
    parser = configparser.ConfigParser()
    parser.read(points)
    for name, target in (parser["console_scripts"].items() if "console_scripts" in parser else []):
        module, _, function = target.partition(":")
        launcher = site / "bin" / name
        launcher.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\n"
                            f"sys.exit({function}())\n")
        launcher.chmod(0o755)
        print(f"wrote {launcher}")
EOF
        fi
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH
    fi
    local java=${JAVA_HOME:+$JAVA_HOME/bin/}java
    timeout 30 "$java" -version 2>&1 || { echo "MISSING: a Java that runs ($java)"; return 1; }
    timeout 60 "$PY" -c 'import ts, model_archiver, orjson, psutil, yaml; print("ts from", ts.__file__)' \
        || { echo "MISSING: a package the server or the load needs (above)"; return 1; }
    command -v torchserve > /dev/null || [[ -x $(dirname "$(command -v "$PY")")/torchserve ]] \
        || { echo "MISSING: the torchserve launcher"; return 1; }
}

build() {  # WORK LIMIT: an isolated config on free ports, and the archive registered in it
    local work=$1 limit=$2 args
    # shellcheck disable=SC2206  # a list of arguments
    args=(${GPU_SERVE_BUILD_ARGS:-$BUILD_DEFAULTS})
    timeout 60 "$PY" -c 'import sys
from pathlib import Path
from embedserve.scripts.serverctl import isolated_config
isolated_config(Path(sys.argv[1]), Path("config.properties"), async_logging="true")' "$work" || return 1
    echo "build_mar.sh --model $MODEL --name minilm ${args[*]}"
    timeout --kill-after=10 "$limit" env PYTHON="$PY" ./build_mar.sh --model "$MODEL" --name minilm \
        --export-path "$work/model_store" --config "$work/config.properties" "${args[@]}"
}

mps_start() {  # GPU_SERVE_MPS=1 on a GPU: CUDA MPS's control daemon; the workers inherit its folders
    MPS_STATE="off"
    [[ ${GPU_SERVE_MPS:-0} == 1 ]] || return 0
    local control
    if [[ $DEVICE != cuda ]]; then
        MPS_STATE="asked; not run: no GPU"
    elif ! control=$(command -v nvidia-cuda-mps-control); then
        MPS_STATE="asked; not run: nvidia-cuda-mps-control is not on PATH"
    else
        export CUDA_MPS_PIPE_DIRECTORY=$STAGE/mps/pipe CUDA_MPS_LOG_DIRECTORY=$STAGE/mps/log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        if timeout 20 "$control" -d; then
            MPS_STATE="on"
        else
            MPS_STATE="asked; not run: nvidia-cuda-mps-control -d failed ($(tail -n 3 "$CUDA_MPS_LOG_DIRECTORY"/control.log 2> /dev/null | tr '\n' ' '))"
        fi
    fi
    echo "CUDA MPS: $MPS_STATE"
}

mps_stop() {
    [[ ${MPS_STATE:-off} == on ]] || return 0
    echo quit | timeout 20 nvidia-cuda-mps-control && echo "CUDA MPS stopped"
}

report() {  # the steps and the first failure into serving.json, whatever the serve step left there
    "$PY" - "$OUT" "$BUDGET" "$(elapsed)" "${FAILED[@]}" <<'EOF'
import json, os, sys
from pathlib import Path
out, budget, elapsed, failed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
path = out / "serving.json"
try:
    data = json.loads(path.read_text())
except (OSError, ValueError):
    data = {"complete": False, "phase": None, "failed_step": None, "errors": {}}
steps = [dict(zip(("step", "exit", "seconds"), line.split("\t")))
         for line in (out / "steps.tsv").read_text().splitlines() if line]
data.update(steps=steps, budget_s=budget, script_s=elapsed, mps=os.environ.get("MPS_STATE", "off"))
if failed:
    first = failed[0]
    if first == "serve" and data.get("failed_step"):
        first = f"serve: {data['failed_step']}"  # where the serve step was when it failed
    data["failed_step"] = first
    data["complete"] = False
path.write_text(json.dumps(data, indent=2))
shapes = data.get("shapes", [])
print(f"serving.json: complete {data.get('complete')}, failed step: {data.get('failed_step') or 'none'}")
for row in shapes:
    name = f"{row.get('clients')}x{row.get('texts_per_request')} at {row.get('workers')} workers"
    if "texts_per_s" in row:
        gpu = f", GPU util mean {row['gpu_util_mean']}% max {row['gpu_util_max']}%" if "gpu_util_mean" in row else ""
        print(f"  {name}: {row['texts_per_s']} texts/s, p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, "
              f"errors {row['errors'] or 0}{gpu}")
    else:
        print(f"  {name}: {row.get('error') or row.get('skipped')}")
sizing = data.get("sizing", {})
if "per_worker_at_load_mib" in sizing:
    print(f"  GPU memory a worker: {sizing['per_worker_idle_mib']} MiB idle, {sizing['per_worker_at_load_mib']} MiB "
          f"at load; {sizing['workers_within_share']} workers within {sizing['share']:.0%} of "
          f"{sizing['memory_total_mib']} MiB")
target = data.get("target", {})
if target.get("met") is not None:
    print(f"  target {target['texts_per_s']} texts/s at {target['clients']} clients: "
          f"{'met' if target['met'] else 'MISSED'} ({target['best_texts_per_s']}, {target['best_shape']})")
EOF
}

main() {
    START=$SECONDS
    FAILED=()
    : > "$OUT/steps.tsv"
    echo "== gpu_serve into $OUT, budget ${BUDGET}s, $(date -u '+%Y-%m-%d %H:%M:%S') UTC, $(hostname)"
    if ((STAGE_ONLY)); then
        here stage "$(left)" stage && here install 60 install
        local rc=$?
        echo "== gpu_serve --stage-only: exit $rc; staged in $STAGE"
        return "$rc"
    fi
    CUDA=0
    if [[ $DEVICE == cuda ]]; then
        CUDA=1
    elif [[ $DEVICE == auto ]]; then
        if command -v nvidia-smi > /dev/null; then
            timeout 20 nvidia-smi -L && CUDA=1
        else
            CUDA=$(timeout 120 "$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2> /dev/null || echo 0)
        fi
    fi
    if ((CUDA)); then
        DEVICE=cuda
        # What `make serve` builds on a GPU machine (device and dtype auto resolve to these there; the
        # CPU-only parts of an auto build, the ONNX export and the bfloat16 check, are left out).
        BUILD_DEFAULTS="--device cuda --dtype float16"
        BATCH_TEXTS=${GPU_SERVE_BATCH_TEXTS:-100000}
    else
        DEVICE=cpu
        # A quick CPU build for the dry run: PyTorch's engine, one worker, no checks.
        BUILD_DEFAULTS="--device cpu --dtype float32 --set engine=torch --workers 1 --skip-check"
        BATCH_TEXTS=${GPU_SERVE_BATCH_TEXTS:-2000}
        # Here, unless the archive is there, the installed Java and TorchServe.
        [[ -f $RUNTIME || -x $STAGE/runtime/jre/bin/java ]] || RUNTIME=installed
    fi
    echo "device: $DEVICE; runtime: $RUNTIME; model: $MODEL_SOURCE"
    WORK=$(mktemp -d /tmp/gpu-serve.XXXXXX) || return 1
    MODEL=""
    local limit
    mps_start
    export MPS_STATE
    if here stage "$(left)" stage && here install 60 install && limit=$(left "$SERVE_MIN") \
        && skip_if_short build "$limit" && here build "$limit" build "$WORK" "$limit"; then
        limit=$(left)
        step serve "$limit" "$PY" -m bench.gpu_serve run --config "$WORK/config.properties" --workdir "$WORK" \
            --model "$MODEL" --out "$OUT" --device "$DEVICE" --deadline "$(($(date +%s) + limit - 2))" \
            --seconds "${GPU_SERVE_SHAPE_SECONDS:-12}" --warmup "${GPU_SERVE_WARMUP_SECONDS:-4}" \
            --processes "${GPU_SERVE_PROCESSES:-0}" ${GPU_SERVE_SHAPES:+--shapes "$GPU_SERVE_SHAPES"} \
            ${GPU_SERVE_WORKERS:+--workers "$GPU_SERVE_WORKERS"} \
            ${GPU_SERVE_SWEEP_SHAPES:+--sweep-shapes "$GPU_SERVE_SWEEP_SHAPES"} --batch-texts "$BATCH_TEXTS"
    fi
    if [[ -f $WORK/config.properties ]]; then
        here stop "$STOP_LIMIT" timeout --kill-after=5 "$STOP_LIMIT" "$PY" -m bench.gpu_serve stop \
            --config "$WORK/config.properties" --workdir "$WORK"
    fi
    for log in "$WORK"/logs/{ts_log,model_log}.log; do  # the server's logs, their last lines (no access log)
        [[ -f $log ]] && grep -v ACCESS_LOG "$log" | tail -n 2000 > "$OUT/$(basename "$log")"
    done
    mps_stop
    report
    rm -rf "$WORK"
    if ((${#FAILED[@]})); then
        echo "== gpu_serve done in $(elapsed)s; failed: ${FAILED[*]}"
        return 1
    fi
    echo "== gpu_serve done in $(elapsed)s"
}

main 2>&1 | tee "$OUT/gpu_serve.log"
exit "${PIPESTATUS[0]}"
