#!/usr/bin/env bash
# The bf16 engine on a GPU machine, in one go:
#   scripts/gpu_bench.sh selftest  `nanoeuler selftest` alone
#   scripts/gpu_bench.sh quick   self-test (every kernel, fp32 and bf16), GPU gradcheck, bench row B16xT512
#   scripts/gpu_bench.sh full    bench rows B16xT512, B16xT1024, B64xT512 (torch eager/compile, ours fp32/bf16)
#   scripts/gpu_bench.sh agree   300 steps of bf16 vs fp32 training of the `gpu` preset on fixed data
# Modes can be combined: `scripts/gpu_bench.sh quick agree`. Logs and JSON go to $LOG_DIR
# (default: $TMPDIR/nanoeuler-gpu-bench); a summary is printed last.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nanoeuler-gpu-bench}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
unset CUPY_TF32
summary=()
run() {  # run NAME LOG CMD...
    local name=$1 log=$2; shift 2
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$LOG_DIR/$log"
    summary+=("$(printf '%-12s rc=%-3s %5ss' "$name" "${PIPESTATUS[0]}" $((SECONDS - t0)))")
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | tee "$LOG_DIR/env.log"
for mode in "${@:-quick}"; do
    case $mode in
        selftest)
            run selftest selftest.log $PY -m nanoeuler selftest ;;
        quick)
            run selftest selftest.log $PY -m nanoeuler selftest
            run gradcheck gradcheck.log $PY -m nanoeuler gradcheck --device gpu
            run bench16x512 bench_quick.log $PY bench/train_gpu.py --rows 16x512 --json "$LOG_DIR/bench_quick.json" ;;
        full)
            run bench bench_full.log $PY bench/train_gpu.py --rows "${ROWS:-16x512,16x1024,64x512}" \
                --fp32-steps 10 --modes "${MODES:-torch-eager,torch-compile,ours-fp32,ours-bf16,ours-bf16-fa32}" --profile --json "$LOG_DIR/bench_full.json" ;;
        agree)
            run agree agree.log $PY bench/train_gpu.py --agree "${AGREE_STEPS:-300}" --json "$LOG_DIR/agree.json" ;;
        *) echo "unknown mode $mode"; exit 2 ;;
    esac
done
echo
echo "=== selftest failures (if any)"
grep -E "FAIL|passed" "$LOG_DIR/selftest.log" 2>/dev/null | tail -15
echo "=== gradcheck"
tail -3 "$LOG_DIR/gradcheck.log" 2>/dev/null
echo "=== bench tables"
for f in "$LOG_DIR"/bench_*.log; do [ -f "$f" ] && sed -n '/^row /,$p' "$f"; done
grep -E "^final" "$LOG_DIR/agree.log" 2>/dev/null
printf '%s\n' "${summary[@]}"
