#!/usr/bin/env bash
# The peer on the same machine (docs/gpu.md, "The peer"): Infinity serving the same model folder,
# driven by the same load client over the same shapes as scripts/gpu_serve.sh drives TorchServe.
# A call of its own on the warm machine, after gpu_serve.sh (whose call carries 59 of its 64 MiB):
#
#   scripts/gpu_peer.sh OUTDIR
#
# It needs build/gpu/peer.tar (scripts/gpu_bundle.sh: Infinity 0.0.78's wheels and those of the
# transformers 4.x and sentence-transformers 3.x it needs, for the GPU machine's Python) and the
# model folder that gpu_serve.sh staged (or GPU_PEER_MODEL). The steps, within one budget:
#
#   stage    the wheels into a folder of their own ($STAGE/peer-site), put before the machine's
#            packages for Infinity alone (the project's own runs keep the machine's transformers)
#   peer     python -m bench.peer_serve: start Infinity (torch engine, float16 on CUDA), each load
#            shape with the GPU sampled, then stop it
#
# It writes OUTDIR/peer.json (texts/s, p50/p95/p99, errors, GPU utilisation and memory, CPU cores of
# the server and the load per shape; the versions Infinity ran with; the start-up time; the first
# step that failed), OUTDIR/peer_server.log, OUTDIR/gpu_peer.log and OUTDIR/steps.tsv. Without
# CUDA it runs the same steps on the CPU in float32: the dry run (GPU_PEER_PYTHON: an interpreter
# that has Infinity installed, when there are no wheels to stage). Settings, from the environment:
#
#   GPU_PEER_SECONDS=150            the whole run's budget
#   GPU_PEER_DEVICE=auto            auto, cuda or cpu
#   GPU_PEER_WHEELS=build/gpu/peer.tar        the wheels; `installed`: GPU_PEER_PYTHON has Infinity
#   GPU_PEER_PYTHON=$PY             the interpreter that runs Infinity
#   GPU_PEER_MODEL=                 the model folder (default: the one gpu_serve.sh staged)
#   GPU_PEER_SHAPES="1x1 64x1 256x1 64x32 256x32"   clients x texts per request, as gpu_serve.sh's
#   GPU_PEER_SHAPE_SECONDS=12 GPU_PEER_WARMUP_SECONDS=4 GPU_PEER_PROCESSES=0   as gpu_serve.sh's
#   GPU_SERVE_STAGE=/tmp/embedserve-gpu       where gpu_serve.sh staged the model
#   PY=python3                      the interpreter that runs the load
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${1:?usage: scripts/gpu_peer.sh OUTDIR}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_PEER_SECONDS:-150}
DEVICE=${GPU_PEER_DEVICE:-auto}
STAGE=${GPU_SERVE_STAGE:-/tmp/embedserve-gpu}
WHEELS=${GPU_PEER_WHEELS:-build/gpu/peer.tar}
PY=${PY:-python3}
PEER_PY=${GPU_PEER_PYTHON:-$PY}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# shellcheck source=scripts/steps.sh
source scripts/steps.sh

stage() {  # the wheels into $STAGE/peer-site (or Infinity as GPU_PEER_PYTHON has it); the model folder
    SITE=""
    if [[ $WHEELS != installed ]]; then
        [[ -f $WHEELS ]] || { echo "MISSING: $WHEELS (make it with scripts/gpu_bundle.sh; carry it)"; return 1; }
        SITE=$STAGE/peer-site
        rm -rf "$SITE" "$STAGE/peer-wheels" && mkdir -p "$STAGE/peer-wheels" || return 1
        tar -xf "$WHEELS" -C "$STAGE/peer-wheels" || return 1
        timeout 90 "$PEER_PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$STAGE"/peer-wheels/*.whl || return 1
    fi
    MODEL=${GPU_PEER_MODEL:-$(dirname "$(compgen -G "$STAGE/model/*/config.json" | head -n 1)")}
    [[ -f $MODEL/config.json ]] || { echo "MISSING: a model folder (run scripts/gpu_serve.sh first, or set GPU_PEER_MODEL)"; return 1; }
    PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} timeout 60 "$PEER_PY" -c 'import infinity_emb, transformers
print("infinity_emb", infinity_emb.__version__, "with transformers", transformers.__version__)' \
        || { echo "MISSING: Infinity, importable by $PEER_PY"; return 1; }
}

main() {
    START=$SECONDS
    FAILED=()
    : > "$OUT/steps.tsv"
    echo "== gpu_peer into $OUT, budget ${BUDGET}s, $(date -u '+%Y-%m-%d %H:%M:%S') UTC, $(hostname)"
    if [[ $DEVICE == auto ]]; then
        DEVICE=$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2> /dev/null || echo cpu)
    fi
    local dtype=float16
    [[ $DEVICE == cuda ]] || dtype=float32
    here stage 120 stage || { echo "== gpu_peer: exit 1 (stage)"; return 1; }
    local limit
    limit=$(left 5)
    step peer "$limit" "$PY" -m bench.peer_serve --model "$MODEL" --out "$OUT" --python "$PEER_PY" \
        ${SITE:+--pythonpath "$SITE"} --device "$DEVICE" --dtype "$dtype" --deadline "$(($(date +%s) + limit - 10))" \
        ${GPU_PEER_SHAPES:+--shapes "$GPU_PEER_SHAPES"} --seconds "${GPU_PEER_SHAPE_SECONDS:-12}" \
        --warmup "${GPU_PEER_WARMUP_SECONDS:-4}" --processes "${GPU_PEER_PROCESSES:-0}"
    local rc=$?
    echo "== gpu_peer: exit $rc in $(elapsed)s; failed: $(failed_steps)"
    return "$rc"
}

main 2>&1 | tee "$OUT/gpu_peer.log"
exit "${PIPESTATUS[0]}"
