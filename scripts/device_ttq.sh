#!/usr/bin/env bash
# Muon's checks and the time-to-quality benchmark on one GPU machine (bench/time_to_quality.py).
#   scripts/device_ttq.sh check                 # Muon's self-test rows, the GPU tests, the step's overhead
#   scripts/device_ttq.sh sweep RECIPE...       # full pretraining runs, one after another (metrics to $OUT)
# DATA (default .ttqdata) holds the mirror's full-config corpus (train.parquet, val.parquet) and its
# tokenizer.json (snakemake results/tokenizer.json); `sweep` tokenizes them into $WORK/shards first.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DATA=${DATA:-$REPO/.ttqdata}
WORK=${WORK:-/tmp/ttq}
ADAM_LR=${ADAM_LR:+--adam-lr $ADAM_LR}  # the muon recipes' AdamW lr
OUT=${OUT:-/tmp/ttq-out}
PY=${PY:-python3}
export PYTHONPATH="$REPO" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cd "$REPO"

check() {
    nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
    $PY -m nanoeuler selftest --only gemm 2>&1 | grep -E "batched|passed" || true
    $PY -m nanoeuler selftest --only engine 2>&1 | grep -E "muon|passed" || true
    $PY -m pytest -q --tb=short tests/test_gpu_bf16.py -k "graph_replay or resumes or kernels_exist" 2>&1 \
        | grep -vE "^nanoeuler (pretrain|train)" | tail -${TESTLINES:-60} || true
    # Muon's step overhead at the full config's shape (and the AdamW step against torch.compile's)
    $PY bench/train_gpu.py --rows 32x512 --modes "${MODES:-ours-bf16,ours-bf16-muon}" --steps 50 --warmup 10 2>&1 \
        | tail -8
}

shards() {
    [ -f "$WORK/shards/manifest.json" ] && return
    $PY -m nanoeuler tokenize --config config/config.yaml --tokenizer "$DATA/tokenizer.json" \
        --train "$DATA/train.parquet" --val "$DATA/val.parquet" --out "$WORK/shards/manifest.json" --workers 16 2>&1 \
        | tail -3
}

sweep() {
    shards
    for recipe in "$@"; do  # what comes back after each run: its metrics and config, not its weights
        $PY bench/time_to_quality.py run --shards "$WORK/shards/manifest.json" --tokenizer "$DATA/tokenizer.json" \
            --out "$WORK/runs" $ADAM_LR "$recipe"
        (cd "$WORK/runs" && tar czf "$OUT/runs.tgz" */config.yaml */run/metrics.jsonl */stderr.txt)
    done
}

"$@"
