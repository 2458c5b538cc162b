#!/usr/bin/env bash
# The GPU path measured in one command, on a GPU machine without network (docs/gpu.md):
#
#   scripts/gpu_run.sh OUTDIR                           every step, under 10 minutes on one H100
#
# It needs, besides the repository, what `make gpu-travel` puts in build/gpu/ (ignored by git, so
# name it when copying): build/gpu/handler-wheels (orjson for the machine's Python) and
# build/gpu/minilm-fp16 (all-MiniLM-L6-v2 in float16). It writes into OUTDIR, flat:
#
#   gpu_run.log         everything the steps printed, with each step's exit status and time
#   steps.tsv           step, exit status (124/137: its time limit), seconds it took
#   capture_probe.json  what an invalidated CUDA graph capture does (bench/gpu_capture_probe.py)
#   families.json       every tested family in fp16 eager, fp16 graphs, fp16 packed with graphs
#                       and bf16 graphs (bench/gpu_families.py), one process per family
#   gpu.json, gpu.png   python -m bench.gpu on the fp16 model copy, with the time left (gpu.png
#                       only where matplotlib is installed: else `python -m bench.gpu --replot`)
#
# Without CUDA it runs the same steps in CPU mode (the probe then checks only the sync check's
# call): what CI runs. Each step has a time limit; a step that fails or times out is logged and
# the next one runs. Settings, from the environment:
#
#   GPU_RUN_SECONDS=560          the whole run's budget; bench.gpu gets what the steps before left
#   GPU_RUN_DEVICE=auto          auto, cuda or cpu, for every step
#   GPU_RUN_FAMILIES="a b"       the families (default: every one of tests/support/model_families.py)
#   GPU_RUN_FAMILY_MODES=a,b     the modes of each family (default: every mode of the device)
#   GPU_RUN_FAMILY_TEXTS=96      texts per family
#   GPU_RUN_FAMILY_SECONDS=180   each family's time limit (they run side by side)
#   GPU_RUN_JOBS=8               families at a time (2 in CPU mode)
#   GPU_RUN_MODEL=DIR            bench.gpu's model (default build/gpu/minilm-fp16; `none`: its own)
#   BENCH_GPU_ARGS="..."         more arguments for bench.gpu (--texts 64 --repeats 20 ...)
#   PY=python3                   the interpreter that holds PyTorch
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${1:?usage: scripts/gpu_run.sh OUTDIR}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_RUN_SECONDS:-560}
DEVICE=${GPU_RUN_DEVICE:-auto}
PY=${PY:-python3}
MODEL=${GPU_RUN_MODEL:-build/gpu/minilm-fp16}
FAMILY_TEXTS=${GPU_RUN_FAMILY_TEXTS:-96}
FAMILY_SECONDS=${GPU_RUN_FAMILY_SECONDS:-180}
PROBE_SECONDS=120
# The model is carried, never downloaded: a pip without network would otherwise retry for minutes.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PIP_RETRIES=0 PIP_TIMEOUT=5

elapsed() { echo $((SECONDS - START)); }

step() {  # NAME LIMIT CMD...: run CMD under a time limit; log and record how it ended, never fail
    local name=$1 limit=$2
    shift 2
    here "$name" "(limit ${limit}s)" timeout --kill-after=10 "$limit" "$@"
}

here() {  # NAME NOTE CMD...: run CMD (a function of this shell too); log and record how it ended
    local name=$1 note=$2 began=$SECONDS rc
    shift 2
    echo "== $name $note, $(elapsed)s into the run"
    "$@"
    rc=$?
    echo "== $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (time limit)') in $((SECONDS - began))s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - began))" >> "$OUT/steps.tsv"
    return 0
}

install_wheels() {  # the carried wheels, apart from the machine's own packages
    local site
    if "$PY" -c 'import orjson' 2>/dev/null; then
        echo "orjson is importable here: build/gpu/handler-wheels not needed"
        return 0
    fi
    if ! compgen -G "build/gpu/handler-wheels/*.whl" > /dev/null; then
        echo "no orjson and no build/gpu/handler-wheels: make gpu-travel, and carry build/gpu/handler-wheels"
        return 1
    fi
    site=$SCRATCH/site
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
            build/gpu/handler-wheels/*.whl; then
        # A wheel is a zip laid out as installed: without pip, unpacking it is the install.
        echo "pip install failed: unpacking the wheels into $site"
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$site" build/gpu/handler-wheels/*.whl || return 1
    fi
    timeout 60 "$PY" -c 'import orjson; print("orjson", orjson.__version__, "from", orjson.__file__)'
}

versions() {  # what every figure below was measured with
    timeout --kill-after=10 120 "$PY" - "$DEVICE" <<'EOF'
import platform, sys
import torch
cuda = sys.argv[1] == "cuda" or (sys.argv[1] == "auto" and torch.cuda.is_available())
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
for name in ("transformers", "sentence_transformers", "tokenizers", "safetensors", "onnxruntime", "orjson",
             "matplotlib"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except Exception as err:
        print(f"{name}: {type(err).__name__}: {err}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
          f"{p.multi_processor_count} SMs; cuDNN {torch.backends.cudnn.version()}")
else:
    print("CPU mode:", "CUDA not asked for" if sys.argv[1] == "cpu" else "no CUDA device")
import embedserve.handler.assembly  # the handler's own imports (orjson among them)
print("handler imports: ok")
EOF
    local rc=$?
    if [[ $DEVICE != cpu ]] && command -v nvidia-smi > /dev/null; then
        timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.max.sm --format=csv
    fi
    return "$rc"
}

families() {  # every family in its own process, side by side, each under its own limit
    local folder=$1 list parallel
    list=${GPU_RUN_FAMILIES:-$("$PY" -c 'import ast
tree = ast.parse(open("tests/support/model_families.py").read())
print(*next(ast.literal_eval(n.value) for n in tree.body
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "FAMILIES"))')}
    parallel=${GPU_RUN_JOBS:-$([[ $CUDA == 1 ]] && echo 8 || echo 2)}  # CPU mode: CI's two cores
    echo "families: $list ($parallel at a time, ${FAMILY_TEXTS} texts each)"
    for family in $list; do
        while (( $(jobs -rp | wc -l) >= parallel )); do wait -n; done
        (
            began=$SECONDS
            timeout --kill-after=10 "$FAMILY_SECONDS" "$PY" -m bench.gpu_families "$family" --out "$folder" \
                --device "$DEVICE" --texts "$FAMILY_TEXTS" ${GPU_RUN_FAMILY_MODES:+--modes "$GPU_RUN_FAMILY_MODES"} \
                > "$folder/$family.log" 2>&1
            printf '%s %s\n' "$?" "$((SECONDS - began))" > "$folder/$family.rc"
        ) &
    done
    wait
    for log in "$folder"/*.log; do
        echo "-- $(basename "$log" .log): exit $(cut -d' ' -f1 "${log%.log}.rc"), $(cut -d' ' -f2 "${log%.log}.rc")s"
        grep -v '^\s*$' "$log" | tail -n 30
    done
    "$PY" - "$folder" "$OUT/families.json" <<'EOF'
import json, sys
from pathlib import Path
folder, target = Path(sys.argv[1]), Path(sys.argv[2])
rows = {}
for log in sorted(folder.glob("*.log")):
    rc, seconds = (log.with_suffix(".rc").read_text().split() + ["?", "?"])[:2]
    figures = log.with_suffix(".json")
    # A family that wrote no figures died or hung: the tail of its log says how.
    rows[log.stem] = json.loads(figures.read_text()) if figures.is_file() else {"ok": False,
                                                                                 "died": log.read_text()[-3000:]}
    rows[log.stem].update(exit_code=int(rc) if rc.lstrip("-").isdigit() else rc, seconds=seconds)
target.write_text(json.dumps(rows, indent=2))
ok = sum(bool(r.get("ok")) for r in rows.values())
print(f"families: {ok} of {len(rows)} ok -> {target}")
sys.exit(0 if rows and ok == len(rows) else 1)  # the step's status: every family ok
EOF
}

summary() {  # the report's state and its targets, for whoever reads only the log
    "$PY" - "$OUT/gpu.json" <<'EOF'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except (OSError, ValueError) as err:
    sys.exit(f"no gpu.json ({err})")
print(f"gpu.json: complete {report.get('complete')}, {report.get('duration_s')} s, "
      f"errors in: {', '.join(report.get('errors', {})) or 'none'}")
for row in report.get("targets", []):
    state = {True: "met", False: "MISSED", None: "n/a"}[row["met"]]
    print(f"  {state:6} {row['target']}: {json.dumps(row['measured'])} (goal {row['goal']})")
EOF
}

main() {
    START=$SECONDS
    SCRATCH=$(mktemp -d /tmp/gpu-run.XXXXXX) || return 1
    trap 'rm -rf "$SCRATCH"' EXIT
    : > "$OUT/steps.tsv"
    echo "== gpu_run into $OUT, budget ${BUDGET}s, $(date -u '+%Y-%m-%d %H:%M:%S') UTC, $(hostname)"
    # Functions of this shell (wheels sets PYTHONPATH for every later step); their commands have limits.
    here wheels "(local files, no limit)" install_wheels
    CUDA=$(timeout 120 "$PY" -c "import sys, torch; d = sys.argv[1]; print(int(d == 'cuda' or (d == 'auto' and torch.cuda.is_available())))" \
        "$DEVICE" 2> /dev/null || echo 0)
    [[ $CUDA == 1 && $DEVICE == auto ]] && DEVICE=cuda
    [[ $CUDA == 0 ]] && DEVICE=cpu
    here versions "(limit 120s)" versions
    step capture-probe "$PROBE_SECONDS" "$PY" -m bench.gpu_capture_probe --out "$OUT" --device "$DEVICE"

    mkdir -p "$SCRATCH/families"
    here families "(limit ${FAMILY_SECONDS}s each)" families "$SCRATCH/families"

    local args=(--out "$OUT" --device "$DEVICE") left
    if [[ $MODEL != none && -d $MODEL ]]; then
        args+=(--model "$MODEL")
    elif [[ $MODEL != none ]]; then
        echo "no $MODEL: bench.gpu picks its own model (make gpu-travel, and carry build/gpu/minilm-fp16)"
    fi
    # What is left, less the kill's grace and the summary.
    left=$((BUDGET - $(elapsed) - 20))
    if (( left < 60 )); then
        echo "== bench.gpu skipped: ${left}s left of the ${BUDGET}s budget"
        printf 'bench.gpu\tskipped\t0\n' >> "$OUT/steps.tsv"
    else
        # shellcheck disable=SC2086  # BENCH_GPU_ARGS is a list of arguments
        step bench.gpu "$left" "$PY" -m bench.gpu "${args[@]}" ${BENCH_GPU_ARGS:-}
    fi
    summary
    echo "== gpu_run done in $(elapsed)s; in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    return 0
}

main 2>&1 | tee "$OUT/gpu_run.log"
exit "${PIPESTATUS[0]}"
