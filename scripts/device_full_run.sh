#!/usr/bin/env bash
# The full-size run on a GPU machine that has Python 3.12, CuPy and PyTorch but no snakemake/duckdb and
# no network. Steps (each a subcommand; a machine stays warm between calls, so they may be spread over
# several calls of at most a few minutes):
#
#   bash scripts/device_full_run.sh prepare        # with pip + network: .carry/whl/ and .carry/mirror.tar.xz
#   bash scripts/device_full_run.sh install        # GPU machine: wheels -> $SITE, a `nanoeuler` command in $SITE/bin
#   bash scripts/device_full_run.sh start          # unpack the mirror, serve it on 127.0.0.1:8765, start
#                                                  # `snakemake results/samples.md` in $WORK in the background
#   bash scripts/device_full_run.sh wait SECONDS   # follow it; when done: the stage table, results to $OUT
#   TARGETS=... bash scripts/device_full_run.sh more   # snakemake again in the same $WORK (other TARGETS or
#                                                  # CONFIGS; SNAKE_ARGS: more options, e.g. --resources gpu=4)
#   bash scripts/device_full_run.sh time20k SECONDS   # the full 20,000-step schedule on the run's shards
#                                                      # for SECONDS: steps/s and the extrapolated wall time
#   bash scripts/device_full_run.sh full20k start   # the same schedule to the end, in the background
#   bash scripts/device_full_run.sh full20k wait SECONDS  # follow it; when done, its wall time and losses
#   bash scripts/device_full_run.sh memneed CAP...  # short pretraining runs (validation included) with the
#                                                   # pool capped at each CAP bytes: which caps are enough
#   bash scripts/device_full_run.sh dposweep        # DPO again from the run's chat model with other settings
#                                                   # (DPO_SWEEP; by default other seeds, so other held-out
#                                                   # splits), the held-out reward accuracy of each
#   bash scripts/device_full_run.sh portable STEPS [auto]  # pretraining on the portable (or auto) kernels,
#                                                      # memory pool capped at 12 GB; the process's peak GPU memory
#   bash scripts/device_full_run.sh shards         # on a fresh machine: the shards from .carry/corpus + tokenizer
#   MEMCAP=11e9 WORK=DIR bash scripts/device_full_run.sh capped SECONDS   # the whole DAG (DPO overlay
#                                                  # included) as on a card of MEMCAP bytes: the portable
#                                                  # kernels (KERNELS=auto: the Hopper ones), CuPy's pool
#                                                  # capped, `start` + `wait` in one
#   bash scripts/device_full_run.sh compare        # bench/train_gpu.py at B32xT512: Hopper path, portable
#                                                  # path and torch.compile in one run
#
# The pipeline is config/config.yaml with the overlay config/mirror.yaml (sources and step count only).
# Snakemake's `benchmark:` files give each rule's wall time and peak RSS; nvidia-smi is polled every
# 0.5 s for the GPU memory in use, and the `nanoeuler` wrapper logs when each stage starts and ends, so
# scripts/device_stage_table.py can take the peak GPU memory per stage.
set -eu -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SITE=${SITE:-/tmp/nanoeuler-site}
WORK=${WORK:-/tmp/nanoeuler-full}
MIRROR=${MIRROR:-/tmp/nanoeuler-mirror}
PORT=8765
PY=${PYTHON:-python3}
OUT=${OUT:-$WORK/out}
GB12=${MEMCAP:-12000000000}  # the seeds' 12 GB card (MEMCAP: another cap, to find what is needed)
CONFIGS=${CONFIGS:-config/config.yaml config/mirror.yaml}  # relative to the tree; a test may add an overlay
TARGETS=${TARGETS:-results/chat.bin results/samples.md}     # add results/dpo.bin with config/mirror-dpo.yaml

env_setup() {
    export PYTHONPATH="$REPO:$SITE" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
}

prepare() {  # on a machine with network: Python 3.12 manylinux wheels and the packed mirror, in .carry/
    local dest=$REPO/.carry
    mkdir -p "$dest/whl"
    # connection_pool (a snakemake dependency) is published as an sdist only: build its wheel here
    $PY -m pip wheel -q --no-deps "connection_pool>=0.0.3" -w "$dest/whl"
    $PY -m pip download -q --python-version 3.12 --implementation cp --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_28_x86_64 --find-links "$dest/whl" -d "$dest/whl" \
        "snakemake==$($PY -c 'import snakemake; print(snakemake.__version__)')" \
        "duckdb==$($PY -c 'import duckdb; print(duckdb.__version__)')"
    rm -f "$dest"/whl/pulp-*.whl  # 16 MB, only for the ILP scheduler: we run --scheduler greedy
    # what the GPU machine's image has already (its package list): the carried tree is limited to 64 MiB
    for p in attrs certifi charset_normalizer idna jinja2 markupsafe packaging psutil pyyaml requests \
             tabulate typing_extensions wrapt; do rm -f "$dest"/whl/$p-*.whl; done
    # the web parquet files stored uncompressed inside an xz archive: 3 MB smaller than zstd-19 inside it
    local tmp
    tmp=$(mktemp -d)
    cp -r "$REPO/data/mirror" "$tmp/"
    $PY -c "
import glob, pyarrow.parquet as pq
for f in glob.glob('$tmp/mirror/fineweb/**/*.parquet', recursive=True):
    pq.write_table(pq.read_table(f), f, compression='NONE', row_group_size=pq.ParquetFile(f).metadata.num_rows)"
    tar -C "$tmp" -cf - mirror | xz -T2 -9 > "$dest/mirror.tar.xz"
    rm -rf "$tmp"
    du -sh "$dest/whl" "$dest/mirror.tar.xz"
}

install() {
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$REPO"/.carry/whl/*.whl
    shim
    env_setup
    $PY -c "
import importlib
for name in ('snakemake', 'duckdb', 'pyarrow', 'matplotlib', 'yaml', 'regex', 'tqdm', 'requests', 'cupy', 'ml_dtypes'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', '?'))
    except Exception as exc:
        print(name, 'MISSING:', exc)"
}

shim() {
    mkdir -p "$SITE/bin"
    # the rules call `nanoeuler`: run this tree's package, and note when each stage starts and ends
    cat > "$SITE/bin/nanoeuler" <<EOF
#!/usr/bin/env bash
times=\${NANOEULER_STAGE_TIMES:-/dev/null}
echo "\$1 start \$(date +%s.%N)" >> "\$times"
$PY -m nanoeuler "\$@"
rc=\$?
echo "\$1 end \$(date +%s.%N) \$rc" >> "\$times"
exit \$rc
EOF
    chmod +x "$SITE/bin/nanoeuler"
}

start() {
    env_setup
    export NANOEULER_STAGE_TIMES=$WORK/stage_times.txt  # the shim notes each stage's start and end there
    rm -rf "$MIRROR" "$WORK" && mkdir -p "$MIRROR" "$WORK"
    xz -dc "$REPO/.carry/mirror.tar.xz" | tar -C "$MIRROR" -xf -
    setsid $PY "$REPO/scripts/mirror/serve.py" --root "$MIRROR/mirror" --port $PORT > "$WORK/serve.log" 2>&1 < /dev/null &
    setsid nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 \
        > "$WORK/gpu_mem.csv" 2>/dev/null < /dev/null &
    sleep 1
    date +%s.%N > "$WORK/started"
    snake
}

snake() {  # snakemake $TARGETS in $WORK in the background (`more`: again, on the results already there)
    env_setup
    export NANOEULER_STAGE_TIMES=$WORK/stage_times.txt
    cd "$WORK"
    rm -f "$WORK/done"
    setsid bash -c "snakemake -s '$REPO/Snakefile' -d '$WORK' --cores 16 --scheduler greedy \
        $TARGETS ${SNAKE_ARGS:-} --configfile $(for c in $CONFIGS; do case $c in /*) printf "'%s' " "$c" ;; *) printf "'%s/%s' " "$REPO" "$c" ;; esac; done) \
        > '$WORK/snakemake.log' 2>&1; echo \$? > '$WORK/done'; date +%s.%N >> '$WORK/done'" < /dev/null &
    echo "started in $WORK"
}

wait_run() {
    local limit=$1 t0=$SECONDS
    while [ ! -f "$WORK/done" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do
        sleep 10
        echo "[$(date +%T)] $(grep -E '^(rule|localrule) ' "$WORK/snakemake.log" | tail -1) | $(ls -t "$WORK"/logs/*.log 2>/dev/null | head -1 | xargs -r tail -c 300 | tr '\r' '\n' | tail -1)"
    done
    if [ ! -f "$WORK/done" ]; then echo "still running"; return 0; fi
    tail -5 "$WORK/snakemake.log"
    collect
}

collect() {
    mkdir -p "$OUT"
    cd "$WORK"
    tar czf "$OUT/logs.tar.gz" logs benchmarks snakemake.log stage_times.txt gpu_mem.csv done started \
        results/pretrain/metrics.jsonl results/sft/metrics.jsonl results/dpo/metrics.jsonl \
        results/shards/manifest.json 2>/dev/null || true
    cp results/samples.md results/metrics.json results/loss.png "$OUT"/ 2>/dev/null || true
    cp results/release/README.md "$OUT"/model_card.md 2>/dev/null || true
    $PY "$REPO/scripts/device_stage_table.py" "$WORK" | tee "$OUT/stage_table.md"
}

time20k() {  # the full schedule's pretraining on the run's shards, stopped after $1 seconds
    env_setup
    local secs=$1 dir=$WORK/t20k
    mkdir -p "$dir"
    cat > "$dir/cfg.yaml" <<YAML
device: gpu
tokenizer: {vocab_size: 4096}
model: {preset: gpu}
pretrain: {precision: bf16, steps: 20000}
YAML
    local t0
    t0=$(date +%s.%N)
    (while sleep 2; do  # "seconds since launch, newest logged step"
        s=$(tail -1 "$dir/run/metrics.jsonl" 2>/dev/null | grep -o '"step": [0-9]*' | grep -o '[0-9]*$' || true)
        [ -n "$s" ] && awk "BEGIN {print $(date +%s.%N) - $t0, $s}"
    done) > "$dir/progress" &
    local watcher=$!
    timeout "$secs" $PY -m nanoeuler pretrain --config "$dir/cfg.yaml" --shards "$WORK/results/shards/manifest.json" \
        --tokenizer "$WORK/results/tokenizer.json" --out "$dir/base.bin" --run-dir "$dir/run" --no-progress \
        > "$dir/log" 2>&1 || true
    kill $watcher || true
    mkdir -p "$OUT"
    cp "$dir/run/metrics.jsonl" "$OUT/t20k_metrics.jsonl" 2>/dev/null || true
    $PY "$REPO/scripts/device_stage_table.py" --extrapolate "$dir/progress" 20000 | tee "$OUT/t20k.txt"
}

full20k() {  # the full schedule to the end: `start` in the background, `wait SECONDS` to follow it
    env_setup
    local dir=$WORK/full20k
    if [ "$1" = start ]; then
        rm -rf "$dir" && mkdir -p "$dir"
        printf 'device: gpu\ntokenizer: {vocab_size: 4096}\nmodel: {preset: gpu}\npretrain: {precision: bf16, steps: 20000}\n' \
            > "$dir/cfg.yaml"
        date +%s.%N > "$dir/started"
        setsid bash -c "$PY -m nanoeuler pretrain --config '$dir/cfg.yaml' --shards '$WORK/results/shards/manifest.json' \
            --tokenizer '$WORK/results/tokenizer.json' --out '$dir/base.bin' --run-dir '$dir/run' --no-progress \
            > '$dir/log' 2>&1; echo \$? > '$dir/done'; date +%s.%N >> '$dir/done'" < /dev/null > /dev/null 2>&1 &
        echo "started 20,000 steps in $dir"
        return 0
    fi
    local limit=$2 t0=$SECONDS
    while [ ! -f "$dir/done" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do
        sleep 15
        echo "[$(date +%T)] $(tail -1 "$dir/run/metrics.jsonl" 2>/dev/null | cut -c1-120)"
    done
    [ -f "$dir/done" ] || { echo "still running"; return 0; }
    mkdir -p "$OUT"
    cp "$dir/run/metrics.jsonl" "$OUT/full20k_metrics.jsonl"
    tail -3 "$dir/log"
    awk -v s="$(cat "$dir/started")" 'NR == 1 {rc = $1} NR == 2 {printf "20,000 steps: exit %s, wall %.1f s\n", rc, $1 - s}' \
        "$dir/done" | tee "$OUT/full20k.txt"
    grep '"val_loss"' "$dir/run/metrics.jsonl" | tail -2 | tee -a "$OUT/full20k.txt"
}

memneed() {  # which pool caps are enough for pretraining with its validation: one short run per cap
    for cap in "$@"; do
        GB12=$cap portable 100 auto || true
    done
}

dposweep() {  # DPO from the run's chat model with other settings; the held-out metrics of each
    env_setup
    cd "$WORK"
    local spec
    for spec in ${DPO_SWEEP:-"lr=2.0e-5,epochs=1,seed=1" "lr=2.0e-5,epochs=1,seed=2" "lr=2.0e-5,epochs=1,seed=3" "lr=2.0e-5,epochs=1,seed=4"}; do
        local dir=$WORK/dposweep/${spec//[=,]/_}
        mkdir -p "$dir"
        printf 'device: gpu\ndpo: {%s, val_pairs: 60, eval_every: 15, log_every: 5}\n' "$(echo "$spec" | sed 's/=/: /g; s/,/, /g')" \
            > "$dir/cfg.yaml"
        $PY -m nanoeuler dpo --config "$dir/cfg.yaml" --ckpt results/chat.bin --prefs data/prefs/prefs.jsonl \
            --ref results/ref_logps.npz --out "$dir/dpo.bin" --run-dir "$dir/run" --no-progress > "$dir/log" 2>&1 \
            || tail -3 "$dir/log"
        mkdir -p "$OUT" && cp "$dir/run/metrics.jsonl" "$OUT/dpo_${spec//[=,]/_}.jsonl" 2>/dev/null || true
        echo "$spec: $(grep -c . "$dir/run/metrics.jsonl" 2>/dev/null) metric lines; last held-out:"
        grep -E 'accuracy' "$dir/run/metrics.jsonl" | tail -1 | cut -c1-300
    done 2>&1 | tee -a "$OUT/dposweep.txt"
}

shards() {  # the run's shards again, from a corpus and tokenizer carried in .carry/ (a fresh machine)
    env_setup
    mkdir -p "$WORK/results"
    cp "$REPO/.carry/tokenizer.json" "$WORK/results/tokenizer.json"
    $PY -m nanoeuler tokenize --config "$REPO/config/config.yaml" --tokenizer "$WORK/results/tokenizer.json" \
        --train "$REPO/.carry/corpus/train.parquet" --val "$REPO/.carry/corpus/val.parquet" \
        --out "$WORK/results/shards/manifest.json" --workers 16 2>&1 | tail -3
}

portable() {  # the 4070's path: CuPy's pool capped at 12 GB, the process's peak from nvidia-smi
    env_setup
    local steps=$1 kernels=${2:-portable} dir=$WORK/memcap-${2:-portable}
    rm -rf "$dir"  # a fresh run, not a resumed one
    mkdir -p "$dir" "$OUT"
    cat > "$dir/cfg.yaml" <<YAML
device: gpu
tokenizer: {vocab_size: 4096}
model: {preset: gpu}
pretrain: {precision: bf16, kernels: $kernels, steps: $steps, eval_every: $((steps / 2)), log_every: 10,
           checkpoint_every: $steps}
YAML
    setsid nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 \
        > "$dir/apps.csv" 2>/dev/null < /dev/null &
    local smi=$!
    CUPY_GPU_MEMORY_LIMIT=$GB12 $PY -m nanoeuler pretrain --config "$dir/cfg.yaml" \
        --shards "$WORK/results/shards/manifest.json" --tokenizer "$WORK/results/tokenizer.json" \
        --out "$dir/base.bin" --run-dir "$dir/run" --no-progress > "$dir/log" 2>&1 || tail -5 "$dir/log"
    kill $smi || true
    cp "$dir/run/metrics.jsonl" "$OUT/memcap_${kernels}_metrics.jsonl" 2>/dev/null || true
    echo "$kernels kernels: pretrain, $steps steps, pool capped at $GB12 bytes: peak process GPU memory" \
        "$(awk -F', ' '{if ($2 > m) m = $2} END {print m}' "$dir/apps.csv") MiB" | tee -a "$OUT/memcap.txt"
    grep -E '"val_loss"' "$dir/run/metrics.jsonl" | tail -1 | tee -a "$OUT/memcap.txt"
    grep -E '"tokens_per_s"' "$dir/run/metrics.jsonl" | tail -1 | tee -a "$OUT/memcap.txt"
}

capped() {  # the whole DAG from an empty results/ as on a card of $GB12 bytes less its context
    # CuPy reads an integer; KERNELS=auto for a Hopper card (the 80 GB row), portable is the sm_89 path
    export CUPY_GPU_MEMORY_LIMIT=$(printf '%.0f' "$GB12") NANOEULER_KERNELS=${KERNELS:-portable}
    CONFIGS="config/config.yaml config/mirror.yaml config/mirror-dpo.yaml"
    TARGETS="results/chat.bin results/samples.md results/dpo.bin"
    start
    wait_run "$1"
}

compare() {  # one bench run at the full config's B32xT512: the Hopper path, the portable one, torch.compile
    mkdir -p "$OUT"
    $PY "$REPO/bench/train_gpu.py" --rows 32x512 --steps 50 --warmup 5 \
        --modes torch-compile,ours-bf16,ours-bf16-ldm-nofuse,ours-bf16-mma-nofuse 2>&1 | tee "$OUT/compare.txt"
}

case "${1:-}" in
    prepare) prepare ;;
    install) install ;;
    shim) shim ;;
    start) start ;;
    more) snake ;;
    wait) wait_run "${2:-540}" ;;
    collect) collect ;;
    time20k) time20k "${2:-240}" ;;
    portable) portable "${2:-300}" "${3:-portable}" ;;
    full20k) full20k "${2:-start}" "${3:-540}" ;;
    memneed) shift; memneed "$@" ;;
    dposweep) dposweep ;;
    shards) shards ;;
    capped) capped "${2:-540}" ;;
    compare) compare ;;
    *) sed -n 2,31p "$0"; exit 2 ;;
esac
