# Steps under one time budget, shared by scripts/gpu_run.sh and scripts/gpu_serve.sh (sourced
# from the repository root). Each step is logged with its exit status and seconds, recorded in
# $OUT/steps.tsv (name, exit status: 124 or 137 for its time limit, or `skipped`; seconds), and
# named in FAILED when it did not succeed. The sourcing script sets OUT, BUDGET, START=$SECONDS
# and FAILED=(), and may set STEP_KILL_AFTER (seconds between a step's SIGTERM and SIGKILL).

elapsed() { echo $((SECONDS - START)); }

left() {  # [RESERVE]: seconds of the budget left, less RESERVE
    echo $((BUDGET - $(elapsed) - ${1:-0}))
}

here() {  # NAME LIMIT CMD...: run CMD (a function of this shell too, which keeps LIMIT itself); log and record
    local name=$1 limit=$2 began=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s), $(elapsed)s into the run"
    "$@"
    rc=$?
    echo "== $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (time limit)') in $((SECONDS - began))s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - began))" >> "$OUT/steps.tsv"
    ((rc == 0)) || FAILED+=("$name")
    return "$rc"
}

skip_if_short() {  # NAME LIMIT: fails, recording NAME as skipped, when LIMIT is under 10 seconds
    ((${2} >= 10)) && return 0
    echo "== $1 skipped: ${2}s left of the ${BUDGET}s budget"
    printf '%s\tskipped\t0\n' "$1" >> "$OUT/steps.tsv"
    FAILED+=("$1")
    return 1
}

step() {  # NAME LIMIT CMD...: an external command under a time limit, skipped when the budget has no room
    local name=$1 limit=$2
    shift 2
    skip_if_short "$name" "$limit" || return 1
    here "$name" "$limit" timeout --kill-after="${STEP_KILL_AFTER:-10}" "$limit" "$@"
}

failed_steps() {  # the steps that did not succeed, each with how it ended (from steps.tsv)
    local name rc seconds
    while IFS=$'\t' read -r name rc seconds; do
        [[ $rc == 0 ]] && continue
        [[ $rc == skipped ]] && printf '%s (skipped: out of budget) ' "$name" || printf '%s (exit %s) ' "$name" "$rc"
    done < "$OUT/steps.tsv"
}
