#!/usr/bin/env bash
# The decode engine on a GPU machine, in one go: its tests, the benchmark on random weights, a model
# trained for the benchmark and the benchmark on it (the engine of another checkout beside it, when
# BASELINE names one; HF_COMPILE=1 adds the torch.compile row), and Nsight Compute's time of every kernel
# of a decode step.
#   DATA=<dir with gpu.yaml, tok4096.json, shards4096/> scripts/gen_bench.sh [tests] [random] [steps] [trained] [ncu]
#       [ncu64] [ncupass]   (ncupass: PASS=RxH@P, one pass of bench/decode_steps_gpu.py)
#   CORPUS=<dir with train.parquet, val.parquet, tokenizer.json> STEPS=N scripts/gen_bench.sh mirror
#       the full config's model trained N steps (default 8000) on a corpus of the full run (the offline
#       mirror's: scripts/mirror/build.py, then the pipeline's corpus and tokenizer stages), the benchmark
#       on it with the prompts drawn from the corpus's validation text
# scripts/gen_bench_data.sh DIR builds that DATA folder on the CPU (the Python docs, their BPE, shards, config).
# Logs go to $LOG_DIR (default $TMPDIR/nanoeuler-gen-bench); a summary is printed last.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nanoeuler-gen-bench}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
summary=()
run() {  # run NAME CMD... (each stage within STAGE_TIMEOUT seconds)
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "${STAGE_TIMEOUT:-300}" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    summary+=("$(printf '%-10s rc=%-3s %5ss' "$name" "${PIPESTATUS[0]}" $((SECONDS - t0)))")
}
ncu_table() {  # the median time of each kernel over the profiled launches, from ncu's CSV
    $PY - "$1" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
k, u, v = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
times = {}
for r in rows[1:]:
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[r[u]]
    times.setdefault(r[k].split("(")[0], []).append(float(r[v].replace(",", "")) * scale)
total = 0.0
print("| kernel | launches | median us | sum of medians us |")
print("|---|---:|---:|---:|")
for name, ts in sorted(times.items(), key=lambda kv: -statistics.median(kv[1]) * len(kv[1])):
    print(f"| {name} | {len(ts)} | {statistics.median(ts):.2f} | {statistics.median(ts) * len(ts):.1f} |")
    total += statistics.median(ts) * len(ts)
print(f"| all | {sum(map(len, times.values()))} | | {total:.1f} |")
PY
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(tests trained ncu)
for mode in "${modes[@]}"; do
    case $mode in
        tests)
            run tests $PY -m pytest -q -x -p no:cacheprovider tests/test_engine_gpu.py tests/test_engine.py ;;
        random)
            run random $PY bench/generate_gpu.py --no-hf --repeats 3 ;;
        ncu)  # the decode kernels of three greedy steps, after the first ones (eager, then recorded as a graph)
            timeout "${NCU_TIMEOUT:-180}" ncu --graph-profiling node --cache-control none --clock-control none \
                --metrics gpu__time_duration.sum --kernel-name regex:"gemv|attend|embed|argmax|swiglu" \
                --launch-skip 100 --launch-count 249 --csv --log-file "$LOG_DIR/ncu.csv" \
                $PY bench/generate_gpu.py --steps-only 12 > "$LOG_DIR/ncu_run.log" 2>&1
            summary+=("ncu        rc=$?")
            ncu_table "$LOG_DIR/ncu.csv" | tee "$LOG_DIR/ncu_table.md" ;;
        ncu64)  # every kernel of three batch-64 greedy steps (the cuBLAS path), after the first ones
            timeout "${NCU_TIMEOUT:-180}" ncu --graph-profiling node --cache-control none --clock-control none \
                --metrics gpu__time_duration.sum --launch-skip 4300 --launch-count 340 --csv \
                --log-file "$LOG_DIR/ncu64.csv" $PY bench/generate_gpu.py --steps-only 12 --steps-batch 64 \
                > "$LOG_DIR/ncu64_run.log" 2>&1
            summary+=("ncu64      rc=$?")
            ncu_table "$LOG_DIR/ncu64.csv" | tee "$LOG_DIR/ncu64_table.md" ;;
        ncupass)  # every kernel of one pass of bench/decode_steps_gpu.py (PASS=RxH@P, default 4x4@256: a verify pass)
            timeout "${NCU_TIMEOUT:-180}" ncu --graph-profiling node --cache-control none --clock-control none \
                --metrics gpu__time_duration.sum --csv --log-file "$LOG_DIR/ncupass.csv" \
                $PY bench/decode_steps_gpu.py --only "${PASS:-4x4@256}" --reps 2 --repeats 1 \
                > "$LOG_DIR/ncupass_run.log" 2>&1
            summary+=("ncupass    rc=$?")
            ncu_table "$LOG_DIR/ncupass.csv" | tee "$LOG_DIR/ncupass_table.md" ;;
        steps)  # every pass's graph replayed alone, by rows and cache position
            run steps $PY bench/decode_steps_gpu.py ;;
        trained)
            DATA=${DATA:?DATA must name the folder with gpu.yaml, tok4096.json and shards4096/}
            run pretrain $PY -m nanoeuler pretrain --config "$DATA/gpu.yaml" --shards "$DATA/shards4096/manifest.json" \
                --tokenizer "$DATA/tok4096.json" --out "$LOG_DIR/base.bin" --no-progress
            run trained $PY bench/generate_gpu.py --ckpt "$LOG_DIR/base.bin" --repeats 5 \
                $([ -n "${HF_COMPILE:-}" ] || echo --no-hf-compile)
            if [ -n "${BASELINE:-}" ]; then
                (cd "$BASELINE" && export PYTHONPATH=$PWD && timeout "${STAGE_TIMEOUT:-300}" $PY bench/generate_gpu.py --ckpt "$LOG_DIR/base.bin" \
                    --no-hf --repeats 3 2>&1 | tee "$LOG_DIR/baseline.log")
            fi ;;
        mirror)
            CORPUS=${CORPUS:?CORPUS must name the folder with train.parquet, val.parquet and tokenizer.json}
            run tokenize $PY -m nanoeuler tokenize --config config/config.yaml --tokenizer "$CORPUS/tokenizer.json" \
                --train "$CORPUS/train.parquet" --val "$CORPUS/val.parquet" --out "$LOG_DIR/mshards/manifest.json" \
                --workers "$(nproc)"
            printf 'device: gpu\ntokenizer: {vocab_size: 4096}\nmodel: {preset: gpu}\npretrain: {precision: bf16, steps: %s}\n' \
                "${STEPS:-8000}" > "$LOG_DIR/mirror.yaml"
            STAGE_TIMEOUT=${TRAIN_TIMEOUT:-480} run mpretrain $PY -m nanoeuler pretrain --config "$LOG_DIR/mirror.yaml" \
                --shards "$LOG_DIR/mshards/manifest.json" --tokenizer "$CORPUS/tokenizer.json" --out "$LOG_DIR/mirror.bin" \
                --run-dir "$LOG_DIR/mrun" --no-progress
            grep '"val_loss"' "$LOG_DIR/mrun/metrics.jsonl" | tail -1
            run trained $PY bench/generate_gpu.py --ckpt "$LOG_DIR/mirror.bin" --prompt-text "$CORPUS/val.parquet" \
                --repeats 3 --spec-prompts "${SPEC_PROMPTS:-64}" --no-hf-compile ;;
        *) echo "unknown mode $mode"; exit 2 ;;
    esac
done
echo
for f in random baseline trained; do
    [ -f "$LOG_DIR/$f.log" ] && { echo "=== $f"; sed -n '/^NVIDIA\|^| run/,$p' "$LOG_DIR/$f.log" | grep -v "^$"; }
done
[ -f "$LOG_DIR/ncu_table.md" ] && { echo "=== ncu"; cat "$LOG_DIR/ncu_table.md"; }
[ -f "$LOG_DIR/ncu64_table.md" ] && { echo "=== ncu64"; head -30 "$LOG_DIR/ncu64_table.md"; }
[ -f "$LOG_DIR/ncupass_table.md" ] && { echo "=== ncupass ${PASS:-4x4@256}"; head -30 "$LOG_DIR/ncupass_table.md"; }
[ -f "$LOG_DIR/steps.log" ] && { echo "=== steps"; sed -n '/^| pass/,$p' "$LOG_DIR/steps.log"; }
grep -E "passed|failed" "$LOG_DIR/tests.log" 2>/dev/null | tail -3
printf '%s\n' "${summary[@]}"
