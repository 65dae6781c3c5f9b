#!/usr/bin/env bash
# `make gpu-check`: on a machine with a CUDA GPU and CuPy, in one go
#   1. nvcc compiles every kernel file,
#   2. every gpu-marked test (tests/: the kernels, both training engines, decoding, serving, DPO, ...),
#   3. `nanoeuler selftest` (every kernel vs its NumPy reference),
#   4. `nanoeuler gradcheck --device gpu` (float32 GPU vs float64 CPU gradients, every tensor),
#   5. a short timed training run of the 116M `gpu` preset (B16 x T512, random tokens),
# then prints a summary table last. Runs from the source tree (`python -m nanoeuler`), so an image
# with CuPy, NumPy and PyYAML is enough. Full logs go to $LOG_DIR (default: $TMPDIR/nanoeuler-gpu-check).
# Exit status: non-zero when any step failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nanoeuler-gpu-check}
STEPS=${TRAIN_STEPS:-12}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
unset CUPY_TF32  # float32 checks need cuBLAS without TF32

names=() results=() secs=() notes=()
step() {  # step NAME LOGFILE NOTE-COMMAND -- CMD...
    local name=$1 log=$2 note=$3; shift 4
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$LOG_DIR/$log"
    local rc=${PIPESTATUS[0]}
    names+=("$name"); secs+=($((SECONDS - t0)))
    if [ "$rc" -eq 0 ]; then results+=("ok"); else results+=("FAIL ($rc)"); fi
    notes+=("$(eval "$note" 2>/dev/null | tail -1)")
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
    nvcc --version 2>/dev/null | tail -1
    $PY -c "import sys, numpy, cupy; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'cupy', cupy.__version__)"
    $PY -c "import yaml, regex, pyarrow, tqdm; print('yaml regex pyarrow tqdm: present')" 2>&1 | tail -1
} | tee "$LOG_DIR/env.log"

step "nvcc compile" compile.log "grep -E 'passed|failed' $LOG_DIR/compile.log" -- \
    $PY -m pytest -q -p no:cacheprovider tests/test_kernels_compile.py
step "gpu tests" tests.log "grep -E 'passed|failed' $LOG_DIR/tests.log" -- \
    $PY -m pytest -q -p no:cacheprovider -m gpu tests/
step "selftest" selftest.log "grep -E 'of [0-9]+ passed' $LOG_DIR/selftest.log" -- \
    $PY -m nanoeuler selftest
step "gradcheck --device gpu" gradcheck.log "grep -E '^max relative error' $LOG_DIR/gradcheck.log" -- \
    $PY -m nanoeuler gradcheck --device gpu
step "116M train B16xT512" train.log "grep -E '^trainbench:' $LOG_DIR/train.log" -- \
    $PY -m nanoeuler.checks.trainbench --preset gpu --batch 16 --steps "$STEPS"

echo
echo "=== selftest table"
sed -n '/^kernel /,/passed/p' "$LOG_DIR/selftest.log"
echo
echo "=== gpu-check summary ($(head -1 "$LOG_DIR/env.log"))"
printf '%-24s %-9s %6s  %s\n' step result seconds detail
fail=0
for i in "${!names[@]}"; do
    printf '%-24s %-9s %6s  %s\n' "${names[$i]}" "${results[$i]}" "${secs[$i]}" "${notes[$i]}"
    [ "${results[$i]}" = ok ] || fail=1
done
exit $fail
