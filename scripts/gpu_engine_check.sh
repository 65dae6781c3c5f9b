#!/usr/bin/env bash
# The bf16 engine's step variants on a GPU machine, in one go: the bf16 self-test rows and GPU tests
# (accumulation, checkpointing, the DPO head, engine_bytes), then step times and memory at the `gpu`
# preset (bench/engine_steps_gpu.py). Logs to $LOG_DIR (default: $TMPDIR/nanoeuler-engine-check).
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nanoeuler-engine-check}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
unset CUPY_TF32
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
fail=0
$PY -m pytest -q -p no:cacheprovider -m gpu -s tests/test_gpu_bf16_steps.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$LOG_DIR/steps.log" || fail=1
$PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_bf16.py ${BF16_K:+-k "$BF16_K"} 2>&1 \
    | tee "$LOG_DIR/bf16.log" || fail=1
$PY bench/engine_steps_gpu.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/bench.log" || fail=1
echo
echo "=== summary"
grep -hE "passed|failed" "$LOG_DIR/steps.log" "$LOG_DIR/bf16.log" | tail -2
sed -n '/^step /,$p' "$LOG_DIR/bench.log"
exit $fail
