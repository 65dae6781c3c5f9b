#!/usr/bin/env bash
# The GPU paths of the layering and naming change, in one go on a machine with a CUDA GPU and CuPy (no
# kernel source changed: the CPU suite's tests/test_kernels_compile.py compiles them with nvcc):
#   1. the gpu-marked tests of what moved or was renamed: the fp32 ops (launch_per_item) and AdamW
#      reached by name from model/dispatch, the bf16 training engine (kernels/bf16/engine.TrainEngine, its
#      doctests, its step variants), the decode engine (DecodeEngine over gpu.py, PDL from kernels/pdl.py),
#      the server on the GPU, DPO on the engine,
#   2. `nanoeuler selftest` (the bf16 rows build TrainEngine on checks/problem's random problem),
#   3. `nanoeuler gradcheck --device gpu` (gradcheck_gpu on checks/problem),
# then prints a table last. Runs from the source tree; logs go to $LOG_DIR (default:
# $TMPDIR/nanoeuler-layering-check). Exit status: non-zero when any step failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nanoeuler-layering-check}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset CUPY_TF32  # the float32 checks need cuBLAS without TF32

rows=()
step() {  # step NAME SUMMARY-REGEX CMD...: run it (at most STEP_TIMEOUT seconds), keep its log's last matching line
    local name=$1 pattern=$2; shift 2
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "${STEP_TIMEOUT:-300}" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    local rc=${PIPESTATUS[0]} result=ok
    [ "$rc" -eq 0 ] || result="FAIL($rc)"
    rows+=("$(printf '%-10s %-9s %5ss  %s' "$name" "$result" $((SECONDS - t0)) \
        "$(grep -E "$pattern" "$LOG_DIR/$name.log" | tail -1)")")
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 | tee "$LOG_DIR/env.log"
step tests "passed|failed|skipped" $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_bf16.py \
    tests/test_gpu_bf16_steps.py tests/test_engine_gpu.py tests/test_serve_gpu.py tests/test_dpo.py tests/test_dpo_loss.py
step selftest "of [0-9]+ passed" $PY -m nanoeuler selftest
step gradcheck "^max relative error" $PY -m nanoeuler gradcheck --device gpu

echo
echo "=== layering check ($(cat "$LOG_DIR/env.log"))"
printf '%-10s %-9s %6s  %s\n' step result time detail
fail=0
for row in "${rows[@]}"; do
    echo "$row"
    case "$row" in *FAIL*) fail=1 ;; esac
done
exit $fail
