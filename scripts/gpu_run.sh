#!/usr/bin/env bash
# The GPU path measured in one command, on a GPU machine without network (docs/gpu.md):
#
#   scripts/gpu_run.sh OUTDIR                           every step within one budget (400 s)
#
# It needs, besides the repository, what `make gpu-travel` puts in build/gpu/ (ignored by git, so
# name it when copying): build/gpu/handler-wheels (orjson for the machine's Python, the project's
# transformers and sentence-transformers), build/gpu/families (the families' tiny models) and
# build/gpu/minilm-fp16.tar.xz (all-MiniLM-L6-v2 in float16, unpacked here; or the folder itself).
# The steps, in order of what matters most:
#
#   prerequisites       the packages, the carried paths and the GPU, checked in the first seconds;
#                       what is missing is named, and nothing else runs
#   bench.gpu           the headline: every target of python -m bench.gpu (gpu.json, gpu.png)
#   families            every tested family in fp16 eager, fp16 graphs, fp16 packed with graphs
#                       and bf16 graphs (bench/gpu_families.py), one process per family
#   capture-probe       what an invalidated CUDA graph capture does (bench/gpu_capture_probe.py)
#   images              the image models (CLIP, ColPali, ColQwen2) through the handler against the
#                       libraries on the same device: images/s, host over model, min cosine
#                       (bench/gpu_images.py)
#
# It writes into OUTDIR, flat: gpu_run.log (everything printed, each step's exit status and
# time), steps.tsv (step, exit status (124/137: its time limit), seconds), gpu.json and gpu.png
# (gpu.png only where matplotlib is installed: else `python -m bench.gpu --replot`),
# families.json, capture_probe.json and images.json. Each file is rewritten as its step goes, so
# a step cut by its limit leaves what it measured. The steps share one budget: each gets at most
# what is left, less what the steps after it are promised.
#
# Exit status: 0 when every step exited 0 (bench.gpu: every target got a value, met or not;
# families: every family's every mode started and matched its reference); else 1, the failed
# steps named at the end of the log.
#
# Without CUDA it runs the same steps in CPU mode (the probe then checks only the sync check's
# call): what CI runs. Settings, from the environment:
#
#   GPU_RUN_SECONDS=400          the whole run's budget
#   GPU_RUN_DEVICE=auto          auto, cuda or cpu, for every step
#   GPU_RUN_FAMILIES="a b"       the families (default: every one of bench/gpu_families.py)
#   GPU_RUN_FAMILY_MODELS=DIR    their prepared folders (default build/gpu/families where it exists)
#   GPU_RUN_FAMILY_MODES=a,b     the modes of each family (default: every mode of the device)
#   GPU_RUN_FAMILY_TEXTS=96      texts per family
#   GPU_RUN_FAMILY_SECONDS=120   the families' time limit at most (they run side by side)
#   GPU_RUN_JOBS=8               families at a time (2 in CPU mode)
#   GPU_RUN_MODEL=DIR            bench.gpu's model (default build/gpu/minilm-fp16; `none`: its own)
#   BENCH_GPU_ARGS="..."         more arguments for bench.gpu (--texts 64 --repeats 20 ...)
#   BENCH_GPU_FAIL=a,b           bench.gpu sections to fail on purpose (the dry run of a failure)
#   PY=python3                   the interpreter that holds PyTorch
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${1:?usage: scripts/gpu_run.sh OUTDIR}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_RUN_SECONDS:-400}
DEVICE=${GPU_RUN_DEVICE:-auto}
PY=${PY:-python3}
MODEL=${GPU_RUN_MODEL:-build/gpu/minilm-fp16}
FAMILY_TEXTS=${GPU_RUN_FAMILY_TEXTS:-96}
FAMILY_SECONDS=${GPU_RUN_FAMILY_SECONDS:-120}
# Families made here by make gpu-travel (their makers need the project's sentence-transformers);
# a family not there is made in its own process.
FAMILY_MODELS=${GPU_RUN_FAMILY_MODELS-$([[ -d build/gpu/families ]] && echo build/gpu/families)}
# What each later step is promised of the budget when an earlier one takes its limit.
FAMILIES_RESERVE=90
PROBE_RESERVE=40
IMAGES_RESERVE=60
# The model is carried, never downloaded: hub lookups off (a machine without network would
# otherwise wait on them). The tokenizer's threads are left as a served worker has them: the
# handler turns the pool on for a GPU worker (bench.gpu records what ran).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_RETRIES=0 PIP_TIMEOUT=5

# shellcheck source=scripts/steps.sh
source scripts/steps.sh

install_wheels() {  # the carried wheels the machine lacks, before its own packages on the path
    local site wheels
    # A wheel is needed unless its version is installed, or (a compiled one, built for another
    # Python, say) its package imports already.
    mapfile -t wheels < <("$PY" - build/gpu/handler-wheels/*.whl <<'EOF'
import importlib.metadata as metadata, importlib.util, sys
from pathlib import Path
for wheel in sys.argv[1:]:
    if not Path(wheel).is_file():
        continue
    name, version, *tags = Path(wheel).stem.split("-")
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        installed = None
    if installed == version or (tags[-1] != "any" and importlib.util.find_spec(name) is not None):
        print(f"{name} {installed} is installed: {Path(wheel).name} not needed", file=sys.stderr)
    else:
        print(wheel)
EOF
    )
    if ! "$PY" -c 'import orjson' 2>/dev/null && [[ " ${wheels[*]} " != *orjson-* ]]; then
        echo "MISSING: orjson, and no build/gpu/handler-wheels: make gpu-travel, and carry build/gpu/handler-wheels"
        return 1
    fi
    ((${#wheels[@]})) || return 0
    site=$SCRATCH/site
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    echo "installing ${wheels[*]##*/} into $site"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"; then
        # A wheel is a zip laid out as installed: without pip, unpacking it is the install.
        echo "pip install failed: unpacking the wheels into $site"
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$site" "${wheels[@]}" || return 1
    fi
}

prerequisites() {  # everything the steps need, named when missing, before any of them runs
    install_wheels || return 1
    if [[ $MODEL != none && ! -f $MODEL/config.json && -f $MODEL.tar.xz ]]; then  # carried packed
        "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
            "$MODEL.tar.xz" "$(dirname "$MODEL")" && echo "unpacked $MODEL.tar.xz"
    fi
    if [[ $MODEL != none && ! -f $MODEL/config.json ]]; then
        echo "MISSING: $MODEL (make gpu-travel, and carry build/gpu/minilm-fp16.tar.xz; GPU_RUN_MODEL=none uses a random model)"
        return 1
    fi
    timeout --kill-after=10 90 "$PY" - "$DEVICE" <<'EOF'
import importlib, platform, sys

missing = []
versions = {}
for name in ("torch", "transformers", "sentence_transformers", "tokenizers", "safetensors", "numpy", "orjson",
             "matplotlib", "onnxruntime"):
    try:
        versions[name] = importlib.import_module(name).__version__
    except Exception as err:
        versions[name] = f"{type(err).__name__}: {err}"
        if name not in ("matplotlib", "onnxruntime"):  # the plot can be drawn later (--replot); ONNX is CPU only
            missing.append(name)
print(f"python {platform.python_version()}", *(f"{k} {v}" for k, v in versions.items()), sep="\n  ")
try:
    import embedserve.handler.assembly  # the handler's own imports
    import bench.gpu.__main__, bench.gpu_families, bench.gpu_capture_probe, bench.gpu_images  # and the steps'
except Exception as err:
    missing.append(f"the handler's or the benchmark's imports ({type(err).__name__}: {err})")
import torch

asked = sys.argv[1]
cuda = asked == "cuda" or (asked == "auto" and torch.cuda.is_available())
if cuda:
    try:
        p = torch.cuda.get_device_properties(0)
        x = torch.randn(256, 256, device="cuda", dtype=torch.float16)
        assert torch.isfinite((x @ x).float()).all().item()  # the GPU runs a kernel
        print(f"GPU {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
              f"{p.multi_processor_count} SMs; CUDA {torch.version.cuda}; cuDNN {torch.backends.cudnn.version()}")
    except Exception as err:
        missing.append(f"a working GPU ({type(err).__name__}: {err})")
elif asked == "cuda":
    missing.append("CUDA (GPU_RUN_DEVICE=cuda)")
else:
    print("CPU mode:", "CUDA not asked for" if asked == "cpu" else "no CUDA device")
if missing:
    print("MISSING:", "; ".join(missing))
    sys.exit(1)
print("every prerequisite is here")
EOF
    local rc=$?
    if [[ $DEVICE != cpu ]] && command -v nvidia-smi > /dev/null; then
        timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.max.sm,utilization.gpu \
            --format=csv
    fi
    return "$rc"
}

families() {  # FOLDER LIMIT: every family in its own process, side by side, all within LIMIT seconds
    local folder=$1 limit=$2 began=$SECONDS list parallel remaining
    list=${GPU_RUN_FAMILIES:-$("$PY" -c 'from bench.gpu_families import FAMILIES; print(*FAMILIES)')}
    parallel=${GPU_RUN_JOBS:-$([[ $CUDA == 1 ]] && echo 8 || echo 2)}  # CPU mode: CI's two cores
    echo "families: $list ($parallel at a time, ${FAMILY_TEXTS} texts each)"
    for family in $list; do
        while (( $(jobs -rp | wc -l) >= parallel )); do wait -n; done
        remaining=$((limit - (SECONDS - began)))
        if ((remaining < 10)); then  # (timeout 0 would mean no limit at all)
            echo "not started: the families' ${limit}s were spent" > "$folder/$family.log"
            echo "skipped 0" > "$folder/$family.rc"
            continue
        fi
        (
            started=$SECONDS
            # Each family writes its file after every mode: one stopped here keeps what it finished.
            timeout --kill-after=5 "$remaining" "$PY" -m bench.gpu_families "$family" \
                --out "$folder" --device "$DEVICE" --texts "$FAMILY_TEXTS" \
                ${FAMILY_MODELS:+--models "$FAMILY_MODELS"} \
                ${GPU_RUN_FAMILY_MODES:+--modes "$GPU_RUN_FAMILY_MODES"} > "$folder/$family.log" 2>&1
            printf '%s %s\n' "$?" "$((SECONDS - started))" > "$folder/$family.rc"
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
    # A family that wrote no figures died or hung before its first mode: its log's tail says how.
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
    state = {True: "met", False: "MISSED", None: "n/a" if not row["applicable"] else "NO VALUE"}[row["met"]]
    reason = f" [{row['reason']}]" if row.get("reason") else ""
    print(f"  {state:8} {row['target']}: {json.dumps(row['measured'])} (goal {row['goal']}){reason}")
EOF
}

main() {
    START=$SECONDS
    FAILED=()
    SCRATCH=$(mktemp -d /tmp/gpu-run.XXXXXX) || return 1
    trap 'rm -rf "$SCRATCH"' EXIT
    : > "$OUT/steps.tsv"
    echo "== gpu_run into $OUT, budget ${BUDGET}s, $(date -u '+%Y-%m-%d %H:%M:%S') UTC, $(hostname)"
    CUDA=$(timeout 120 "$PY" -c "import sys, torch; d = sys.argv[1]; print(int(d == 'cuda' or (d == 'auto' and torch.cuda.is_available())))" \
        "$DEVICE" 2> /dev/null || echo 0)
    [[ $CUDA == 1 && $DEVICE == auto ]] && DEVICE=cuda
    [[ $CUDA == 0 && $DEVICE == auto ]] && DEVICE=cpu
    # A function of this shell: the wheels put on PYTHONPATH serve every later step.
    if ! here prerequisites 90 prerequisites; then
        echo "== gpu_run stopped: a prerequisite is missing (the MISSING line above)"
        return 1
    fi

    local args=(--out "$OUT" --device "$DEVICE")
    [[ $MODEL != none ]] && args+=(--model "$MODEL")
    # shellcheck disable=SC2086  # BENCH_GPU_ARGS is a list of arguments
    step bench.gpu "$(left $((FAMILIES_RESERVE + PROBE_RESERVE + IMAGES_RESERVE)))" "$PY" -m bench.gpu "${args[@]}" \
        ${BENCH_GPU_ARGS:-}
    summary

    local limit
    limit=$(left $((PROBE_RESERVE + IMAGES_RESERVE)))
    ((limit > FAMILY_SECONDS)) && limit=$FAMILY_SECONDS
    mkdir -p "$SCRATCH/families"
    # A function of this shell: each family's process has its own limit within this one.
    skip_if_short families "$limit" && here families "$limit" families "$SCRATCH/families" "$limit"

    step capture-probe "$(left "$IMAGES_RESERVE")" "$PY" -m bench.gpu_capture_probe --out "$OUT" --device "$DEVICE"

    step images "$(left 5)" "$PY" -m bench.gpu_images --out "$OUT" --device "$DEVICE"

    echo "== gpu_run done in $(elapsed)s of ${BUDGET}s; in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    if ((${#FAILED[@]})); then
        echo "== steps that did not succeed: $(failed_steps)"
        return 1
    fi
    return 0
}

main 2>&1 | tee "$OUT/gpu_run.log"
exit "${PIPESTATUS[0]}"
