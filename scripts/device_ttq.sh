#!/usr/bin/env bash
# Muon's checks and the time-to-quality benchmark on one GPU machine (bench/time_to_quality.py).
#   scripts/device_ttq.sh check                 # the self-test rows and GPU tests of Muon, the heads' loss
#                                               # weights and the ordered sums; the step's Muon overhead
#   scripts/device_ttq.sh sweep RECIPE...       # full pretraining runs, one after another (metrics to $OUT)
# DATA (default .ttqdata) holds the mirror's full-config corpus (train.parquet, val.parquet) and its
# tokenizer.json (snakemake results/tokenizer.json); `sweep` tokenizes them into $WORK/shards first, once
# (kept while the machine stays warm). Every run of a sweep reuses the CuPy kernels the first compiled
# ($CUPY_CACHE_DIR), and a recipe starts only while the last run's time still fits in BUDGET seconds
# (a device call has 600): three recipes of ~2 minutes each (an H200 at 3000 steps) fit, e.g.
#   scripts/device_ttq.sh sweep muon_1e-3 muon_1.4e-3 muon_2e-3+mtp
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DATA=${DATA:-$REPO/.ttqdata}
WORK=${WORK:-/tmp/ttq}
ADAM_LR=${ADAM_LR:+--adam-lr $ADAM_LR}  # the muon recipes' AdamW lr (default: config.yaml's, 6e-4)
OUT=${OUT:-/tmp/ttq-out}
PY=${PY:-python3}
BUDGET=${BUDGET:-540}
# the tuned baseline of the report: the first sweep's AdamW at 6e-4 on an H200 (BENCHMARKS.md: best val
# bits/byte, its step, training seconds); empty: the AdamW run in $WORK/runs
BASELINE=${BASELINE-1.2380,3000,85}
export PYTHONPATH="$REPO" PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$WORK/cupy}
mkdir -p "$OUT" "$WORK"
cd "$REPO"

check() {
    nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
    $PY -m nanoeuler selftest --only gemm 2>&1 | grep -E "batched|passed" || true
    for only in sumsq muon ce_heads engine; do
        $PY -m nanoeuler selftest --only $only 2>&1 | grep -E "sumsq|muon|poly|head|engine|passed|FAIL" || true
    done
    $PY -m pytest -q --tb=short tests/test_gpu_bf16.py tests/test_gpu_bf16_steps.py \
        -k "graph_replay or resumes or kernels_exist or head_weights or bit_identical or engine_bytes" 2>&1 \
        | grep -vE "^nanoeuler (pretrain|train)" | tail -${TESTLINES:-60} || true
    # Muon's step overhead at the full config's shape (and the AdamW step against torch.compile's)
    $PY bench/train_gpu.py --rows 32x512 --modes "${MODES:-ours-bf16,ours-bf16-muon}" --steps 50 --warmup 10 2>&1 \
        | tail -8
}

shards() {
    [ -f "$WORK/shards/manifest.json" ] && { echo "shards: cached in $WORK/shards"; return; }
    local t0=$SECONDS
    $PY -m nanoeuler tokenize --config config/config.yaml --tokenizer "$DATA/tokenizer.json" \
        --train "$DATA/train.parquet" --val "$DATA/val.parquet" --out "$WORK/shards/manifest.json" --workers 16 2>&1 \
        | tail -3
    echo "shards: $((SECONDS - t0)) s"
}

sweep() {
    shards
    local last=0 t0 ran=()
    for recipe in "$@"; do  # what comes back after each run: its metrics and config, not its weights
        if ((SECONDS + last > BUDGET)); then
            echo "$recipe: not started ($SECONDS s gone, the last run took $last s, BUDGET $BUDGET s)"
            continue
        fi
        t0=$SECONDS
        $PY bench/time_to_quality.py run --shards "$WORK/shards/manifest.json" --tokenizer "$DATA/tokenizer.json" \
            --out "$WORK/runs" $ADAM_LR "$recipe"
        last=$((SECONDS - t0))
        ran+=("$recipe")
        (cd "$WORK/runs" && tar czf "$OUT/runs.tgz" */config.yaml */run/metrics.jsonl */stderr.txt)
    done
    echo "ran ${ran[*]:-nothing} in $SECONDS s"
    $PY bench/time_to_quality.py report "$WORK/runs" ${BASELINE:+--baseline $BASELINE} || true
}

"$@"
