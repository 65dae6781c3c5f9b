#!/usr/bin/env bash
# The open work's device runs on one 4-GPU host (H100 or H200), in parallel, each job on its own GPUs: about
# 25 minutes of wall time in all. The carried tree is limited to 64 MiB, so the wheels, the mirror and the
# server's wheels travel in three short calls; then `follow` calls until every job is done:
#
#   bash scripts/device_x4.sh install       # carry .carry/whl: snakemake + duckdb (device_full_run.sh install)
#   bash scripts/device_x4.sh start         # carry .carry/mirror.tar.xz: the data stages and the jobs, in the background
#   bash scripts/device_x4.sh serve         # carry .carry/serve: the server's wheels (its job waits for them)
#   bash scripts/device_x4.sh follow SECS   # progress for SECS seconds; finished jobs' tables to $OUT; the summary
#
# job        GPUs  what (the pipeline first, on an idle host, so its timings are its own)
# data       -     the 270M pipeline's data stages (mirror -> corpus -> tokenizer -> shards), on the CPU
# ttq_check  0     meanwhile: scripts/device_ttq.sh check (Muon's GPU tests and its step overhead)
# pipeline   0-3   the 270M DAG to its release, pretraining and SFT on 4 GPUs; then the 270M step at 1 and 4
#                  GPUs (bench/parallel_gpu.py scale)
# g270       0     after it: scripts/gpu_270m.sh, then scripts/gpu_check.sh (make gpu-check)
# twonode    1,2   after it: scripts/gpu_parallel.sh twonode, two "nodes" of one rank each, NCCL over sockets
# ttq_a      1     after twonode: time to quality, the tuned AdamW baseline and Muon on a 1750-step schedule
# ttq_b      2     after twonode: config.yaml's recipe at 3000 steps (the 116M beside the 270M), with the heads' fade
# serve      3     after the pipeline: scripts/device_serve.sh load with a 600 s soak at 32 streams
# zero       0-3   after ttq_a and ttq_b: scripts/gpu_parallel.sh zero (2 and 4 GPUs; bit for bit, so it may
#                  share GPUs 0 and 3 with the checks and the soak)
#
# PLAN=checks (no pipeline, no mirror: carry only .carry/serve/whl; `install` is not needed), about 16 minutes:
# serve      3     the server at 32 and 64 streams beside the in-process engine, 10 requests a client
# zero16     1,2   meanwhile: scripts/gpu_parallel.sh zerobf16 on 2 GPUs (ZeRO-1 on the bf16 engine)
# soak       3     after serve: 32 streams for 600 s, memory sampled (device_serve.sh load, SOAK=600)
# gpucheck   0     after serve: scripts/gpu_check.sh (make gpu-check: every gpu-marked test, selftest, gradcheck),
#                  then bench/embedding_gpu.py
# zero       0-3   after gpucheck and zero16: scripts/gpu_parallel.sh zero, then zero16, on 4 GPUs (it shares
#                  GPU 3 with the soak, whose figures are memory and failures, not speed)
# Logs in $X4 (default /tmp/x4); each job's exit status in $X4/NAME.rc.
set -u -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
X4=${X4:-/tmp/x4}
OUT=${OUT:-$X4/out}
export WORK=$X4/pipeline SITE=${SITE:-/tmp/nanoeuler-site} PYTHONUNBUFFERED=1
CONFIGS_270M="config/config.yaml config/mirror.yaml config/mirror-dpo.yaml config/gpu-270m.yaml $X4/gpus4.yaml"
PLAN=${PLAN:-270m}
JOBS="data ttq_check pipeline g270 twonode ttq_a ttq_b serve zero"
[ "$PLAN" = checks ] && JOBS="serve zero16 soak gpucheck zero"
cd "$REPO"

after() {  # wait for the jobs named
    local j
    for j in "$@"; do until [ -f "$X4/$j.rc" ]; do sleep 5; done; done
}

ttq_data() {  # the DAG's corpus and tokenizer where scripts/device_ttq.sh reads them
    mkdir -p "$X4/ttqdata"
    ln -sf "$WORK/data/corpus/train.parquet" "$WORK/data/corpus/val.parquet" "$WORK/results/tokenizer.json" "$X4/ttqdata/"
}

run_job() {  # the body of one job; its output goes to $X4/NAME.log
    export OUT=$X4/jobout  # not the starting call's $OUT, which goes away with it
    case $1 in
    data)  # started by `start` (it unpacks the mirror before the call ends): its end, then the sweeps' shards
        until [ -f "$WORK/done" ]; do sleep 5; done
        tail -3 "$WORK/snakemake.log"
        ttq_data
        DATA=$X4/ttqdata WORK=$X4/ttq bash scripts/device_ttq.sh shards
        return "$(head -1 "$WORK/done")" ;;
    ttq_check)
        CUDA_VISIBLE_DEVICES=0 MODES=torch-compile,ours-bf16,ours-bf16-muon WORK=$X4/ttqcheck \
            bash scripts/device_ttq.sh check ;;
    g270)
        after pipeline
        export CUDA_VISIBLE_DEVICES=0
        LOG_DIR=$X4/g270 bash scripts/gpu_270m.sh; local rc=$?
        until [ -f "$X4/serve-wheels" ]; do sleep 5; done  # the serving tests need FastAPI and llguidance
        PYTHONPATH=$REPO:/tmp/nanoeuler-serve-site LOG_DIR=$X4/gpucheck bash scripts/gpu_check.sh || rc=1
        return $rc ;;
    twonode)
        after pipeline
        CUDA_VISIBLE_DEVICES=1,2 GPUS=2 LOG_DIR=$X4/twonode bash scripts/gpu_parallel.sh twonode ;;
    ttq_a | ttq_b)
        after twonode data
        local gpu=1 recipes="adamw_6e-4 muon_2e-3_1750 muon_2e-3_1750+mtp"
        [ "$1" = ttq_b ] && gpu=2 recipes="muon_2e-3 muon_2e-3+mtp muon_1.4e-3_1750+mtp"
        CUDA_VISIBLE_DEVICES=$gpu DATA=$X4/ttqdata WORK=$X4/ttq OUT=$X4/ttq-out-$1 BUDGET=100000 BASELINE= \
            bash scripts/device_ttq.sh sweep $recipes ;;
    serve)
        [ "$PLAN" = checks ] && { serve_load 32,64 10 0; return; }
        after pipeline
        until [ -f "$X4/serve-wheels" ]; do sleep 5; done
        CUDA_VISIBLE_DEVICES=3 NO_INSTALL=1 SOAK=600 SITE=/tmp/nanoeuler-serve-site WORK=$X4/serve OUT=$X4/serve-out \
            bash scripts/device_serve.sh load ;;
    zero)
        if [ "$PLAN" = checks ]; then
            after gpucheck zero16
            LOG_DIR=$X4/zero GPUS=4 bash scripts/gpu_parallel.sh zero; local rc=$?
            LOG_DIR=$X4/zero16-4 GPUS=4 bash scripts/gpu_parallel.sh zerobf16 || rc=1
            return $rc
        fi
        after ttq_a ttq_b
        LOG_DIR=$X4/zero GPUS=4 bash scripts/gpu_parallel.sh zero ;;
    zero16)
        CUDA_VISIBLE_DEVICES=1,2 LOG_DIR=$X4/zero16 GPUS=2 bash scripts/gpu_parallel.sh zerobf16 ;;
    soak)
        after serve
        serve_load 32 1 600 ;;
    gpucheck)
        after serve
        export CUDA_VISIBLE_DEVICES=0
        PYTHONPATH=$REPO:/tmp/nanoeuler-serve-site LOG_DIR=$X4/gpucheck bash scripts/gpu_check.sh; local rc=$?
        python3 bench/embedding_gpu.py || rc=1  # the sorted fp32 embedding backward against atomics
        return $rc ;;
    pipeline)
        after data ttq_check
        CONFIGS=$CONFIGS_270M TARGETS=results/release/SHA256SUMS SNAKE_ARGS="--resources gpu=4" \
            bash scripts/device_full_run.sh more
        until [ -f "$WORK/done" ]; do sleep 5; done
        OUT=$X4/pipeline-out bash scripts/device_full_run.sh collect
        local rc
        rc=$(head -1 "$WORK/done")
        for n in 1 4; do
            python3 bench/parallel_gpu.py --ranks $n scale --preset gpu-270m --rows 8x512,32x512 \
                --json "$X4/scale270m-$n.json" || rc=1
        done
        return "$rc" ;;
    esac
}

serve_load() {  # LEVELS REQUESTS SOAK: device_serve.sh load on GPU 3, its output in $X4/serve-out-$SOAK
    until [ -f "$X4/serve-wheels" ]; do sleep 5; done
    CUDA_VISIBLE_DEVICES=3 NO_INSTALL=1 LEVELS=$1 REQUESTS=$2 SOAK=$3 SITE=/tmp/nanoeuler-serve-site WORK=$X4/serve \
        OUT=$X4/serve-out-$3 bash scripts/device_serve.sh load
}

start() {
    mkdir -p "$X4" "$OUT"
    if [ "$PLAN" = checks ]; then
        serve_wheels > "$X4/serve-install.log" 2>&1
        launch
        return
    fi
    # batch_size is per GPU: 4 x 8 is the 116M run's global batch of 32, so both train on the same tokens
    printf 'pretrain: {gpus: 4, batch_size: 8}\nsft: {gpus: 4, batch_size: 8}\n' > "$X4/gpus4.yaml"
    local data="results/shards/manifest.json data/alpaca/alpaca.jsonl data/prefs/prefs.jsonl data/hellaswag/hellaswag.jsonl"
    CONFIGS=$CONFIGS_270M TARGETS=$data bash scripts/device_full_run.sh start
    launch
}

launch() {  # every job of the plan in the background, each waiting for what it needs
    for j in $JOBS; do
        setsid bash -c "cd '$REPO'; X4='$X4' PLAN='$PLAN' bash scripts/device_x4.sh job $j > '$X4/$j.log' 2>&1; echo \$? > '$X4/$j.rc'" \
            < /dev/null > /dev/null 2>&1 &
    done
    echo "started: $JOBS (logs in $X4)"
}

serve_wheels() {  # into device_serve.sh's $SITE, which its job then reads without installing again
    SITE=/tmp/nanoeuler-serve-site bash scripts/device_serve.sh install && touch "$X4/serve-wheels"
}

follow() {  # wait up to $1 s for every job; meanwhile one line a job every 30 s
    local t0=$SECONDS j
    while [ $((SECONDS - t0)) -lt "$1" ]; do
        local left=0
        for j in $JOBS; do [ -f "$X4/$j.rc" ] || left=1; done
        [ $left = 0 ] && break
        echo "[$(date +%T)] $(for j in $JOBS; do printf '%s:%s ' "$j" "$(cat "$X4/$j.rc" 2>/dev/null || echo ..)"; done)"
        sleep 30
    done
    pack
    printf '\n%-10s %-6s %s\n' job exit "last line"
    for j in $JOBS; do
        printf '%-10s %-6s %s\n' "$j" "$(cat "$X4/$j.rc" 2>/dev/null || echo running)" "$(tail -1 "$X4/$j.log" 2>/dev/null | cut -c1-90)"
    done
}

pack() {  # what has finished, into $OUT (at most 8 files come back: one archive of the logs and tables)
    mkdir -p "$OUT"
    (cd "$X4" && tar czf "$OUT/x4.tgz" --exclude='*.bin' --exclude='*.npz' --exclude=pipeline --exclude=ttq \
        --exclude=ttqdata --exclude=out --exclude=serve *.log *.rc *.json g270 gpucheck twonode zero zero16* ttq-out-* \
        serve-out* pipeline-out \
        2>/dev/null)
    ls -la "$OUT"
}

case "${1:-}" in
    install) bash scripts/device_full_run.sh install ;;
    start) start ;;
    serve) mkdir -p "$X4" && serve_wheels ;;
    follow) follow "${2:-540}" ;;
    job) run_job "$2" ;;
    *) sed -n 2,25p "$0"; exit 2 ;;
esac
