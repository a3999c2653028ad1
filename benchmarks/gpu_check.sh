#!/usr/bin/env bash
# GPU check, one CUDA device, one call. The device image has python3 (3.12) with a CUDA torch
# and numpy 2 but no fairseq: `make gpu-wheels` (run here, on the CPU machine) puts
# ve-fairseq's prebuilt cp312 wheel, fairscale, their dependencies and the plugin as wheels
# into .whl/, which the call carries.
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   run(command="bash benchmarks/gpu_check.sh offload", carry=[".whl"], timeout_s=540)
# Three parts (benchmarks/gpu_check.py and gpu_offload.py say what each measures and how);
# with `offload`, part 3 alone, with the whole budget:
#   1. benchmarks/results/gpu_check.{md,json}: speed in steady state at the NLLB-600M shape,
#      world size 1, 40 updates each: stock fairseq's fairscale path as shipped (launched
#      with no --user-dir, so no plugin hook is installed in that process), the plugin's
#      default engine, the NLLB configs, the fairscale engine, each memory feature alone,
#      and 16,384 tokens; words/s and ms per update over updates 11-40, MFU, a profile of
#      updates 32-34 (device busy against wall time, kernel launches, top kernels), CUDA
#      peak allocated and reserved, and the launcher of each row;
#   2. benchmarks/results/gpu_memory_600m.{md,json,png}: the 600M table (README,
#      docs/memory.md) measured with CUDA statistics, per rank at world size 2 (fake process
#      group, one device; fairseq's CUDA gradient-norm consistency check is off there, as
#      on CPU: a fake group cannot pass it). Verified on 2026-12-04: it runs only with the
#      seconds part 1 leaves;
#   3. benchmarks/results/gpu_offload_3_3b.{md,json}: the one-GPU 3.3B recipe's settings at
#      world size 1 for 6 updates: CUDA peak, host peak RSS, seconds per update and the
#      update's wait for the host Adam step, in the background and then in line (its own
#      call: `offload`; after part 1, with what is left).
# Time budget, 480 s in all (the call's 540 s less a margin). Each step must end by the sum
# of its budget and those before it, so seconds an earlier step leaves go to the next ones:
#   pip install of .whl/ (wheels only, nothing compiles)                      30 s
#   nvidia-smi                                                                 10 s
#   part 1, trainings (at most 90 s each, in order of importance)            440 s
#   part 3, the 3.3B one-GPU recipe (only the seconds the steps before leave)  0 s
#   part 2, configurations (only the seconds the steps before leave)           0 s
# With `offload`: install 30 s, nvidia-smi 10 s, part 3 440 s. With `from N`: part 1's runs
# from the N-th on (after the stock run, for the ratios), for the runs a first call left.
# Each part writes its results after every run, and they are copied to $OUT (if set) when
# the part ends, so a timeout keeps what finished. The script exits 0 with a summary of
# what ran, whatever a step's outcome (2 only when it cannot start: no fairseq, no .whl/).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SITE=/tmp/fairseq-site
START=$SECONDS
DUE=0         # seconds after START by which the current step must end
SUMMARY=()

# step NAME BUDGET COMMAND...: run COMMAND under a timeout that ends it by its deadline;
# record the outcome. A step is skipped with less than 5 s left.
step() {
    local name=$1 budget=$2
    shift 2
    DUE=$((DUE + budget))
    local left=$((DUE - (SECONDS - START) - 5)) began=$SECONDS code=0
    if [ "$left" -lt 5 ]; then
        SUMMARY+=("$name: skipped, no time left")
        return 1
    fi
    timeout -k 5 "$left" "$@" || code=$?
    local took=$((SECONDS - began))
    case $code in
        0) SUMMARY+=("$name: ok (${took} s)") ;;
        124|137) SUMMARY+=("$name: TIMED OUT after ${took} s (limit ${left} s)") ;;
        *) SUMMARY+=("$name: FAILED, exit $code (${took} s)") ;;
    esac
    return "$code"
}
keep() { if [ -n "${OUT:-}" ]; then cp benchmarks/results/"$1".* "$OUT"/ 2>/dev/null || true; fi; }
summary() {
    echo
    echo "== gpu_check summary ($((SECONDS - START)) s) =="
    printf '  %s\n' "${SUMMARY[@]}"
    for file in benchmarks/results/{gpu_check,gpu_check_from*,gpu_offload_3_3b,gpu_memory_600m}.md; do
        [ -f "$file" ] && { echo "-- ${file##*/}"; cat "$file"; }
    done
    exit 0
}

if ! python3 -c "import fairseq" 2>/dev/null; then
    [ -d .whl ] || { echo "no fairseq and no .whl/: run 'make gpu-wheels' first" >&2; exit 2; }
    # wheels only (make gpu-wheels): ve-fairseq's prebuilt cp312 build, nothing to compile
    step "pip install .whl/ (ve-fairseq, fairscale, deps, the plugin)" 30 \
        python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
    # the checkout before the installed copy of the plugin: its code is what runs
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"
    # fairseq's batching needs its Cython extensions, built against numpy: check they load
    if ! python3 -c "import fairseq, fairscale, fairseq_shard_plugin
import fairseq.data.data_utils_fast, fairseq.data.token_block_utils_fast" \
        || ! command -v fairseq-shard-measure-train >/dev/null; then
        SUMMARY+=("fairseq (with its extensions), fairscale or the plugin not importable: parts skipped")
        summary
    fi
else
    DUE=$((DUE + 30))  # the install's budget goes to the next steps
fi
step "nvidia-smi" 10 nvidia-smi --query-gpu=name,memory.total --format=csv

# part NAME BUDGET RESULTS ARGS...: a step running gpu_check.py ARGS, which is told to stop
# starting runs 15 s before the step's timeout (to write its results and exit by itself).
part() {
    local name=$1 budget=$2 results=$3
    shift 3
    local left=$((DUE + budget - (SECONDS - START) - 5 - 15))
    step "$name" "$budget" python3 -m benchmarks.gpu_check "$@" --budget "$((left > 0 ? left : 0))"
    keep "$results"
}
offload_part() {
    local budget=$1 left=$((DUE + $1 - (SECONDS - START) - 5 - 15))
    step "part 3, 3.3B one-GPU recipe (benchmarks/results/gpu_offload_3_3b.*)" "$budget" \
        python3 -m benchmarks.gpu_offload --budget "$((left > 0 ? left : 0))"
    keep gpu_offload_3_3b
}
if [ "${1:-}" = offload ]; then
    offload_part 440
    summary
fi
if [ "${1:-}" = from ]; then  # `from N`: part 1's runs from the N-th on, after stock's
    part "part 1 from run ${2:?a run number} (benchmarks/results/gpu_check_from$2.*)" 440 \
        "gpu_check_from$2" trainings --from-run "$2"
    summary
fi
part "part 1, steady-state speed (benchmarks/results/gpu_check.*)" 440 gpu_check trainings
offload_part 0
part "part 2, 600M memory table (benchmarks/results/gpu_memory_600m.*)" 0 \
    gpu_memory_600m memory
summary
