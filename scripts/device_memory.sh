#!/usr/bin/env bash
# Each GPU stage briefly at the full config under CuPy pool caps, on the portable kernels (the RTX 4070's
# path): which micro-batch or chunk it chose, its predicted and measured peak device memory, and its speed.
#
#   bash scripts/device_full_run.sh install        # as for the full run: wheels -> $SITE (once per machine)
#   bash scripts/device_full_run.sh shards         # only where $WORK has no shards yet
#   bash scripts/device_memory.sh [ROW ...]        # the rows (default all) at every cap of $CAPS
#   bash scripts/device_memory.sh table            # the table of every row run so far
#   bash scripts/device_memory.sh config ROW FILE  # write one row's config (no GPU needed)
#
# ROW is one of: pretrain-fp32 pretrain-bf16 sft-fp32 sft-bf16 ref-logps dpo-fp32 dpo-bf16 hellaswag-eval
# evaluate sample. A machine stays warm between calls, so the rows may be spread over several calls
# (ref-logps before the dpo rows: they train against its output). Each run appends one line to
# $WORK/memory/rows.tsv; the table follows each call.
#
# $WORK holds what a finished full run leaves (scripts/device_full_run.sh): results/tokenizer.json,
# results/shards/, results/base.bin, results/chat.bin, data/alpaca/alpaca.jsonl, data/prefs/prefs.jsonl,
# data/hellaswag/hellaswag.jsonl. Every stage reads the full config (config/config.yaml: the 116M `gpu`
# model, context 512, batch 32, 16 DPO pairs) with only its length cut short.
#
# The caps: CUPY_GPU_MEMORY_LIMIT limits CuPy's pool, and a stage's gpu_memory (auto) is what the pool may
# take plus the context the process holds, so each cap stands for a card of about that size plus the
# context. "measured" is the pool's high-water mark plus what the process holds outside the pool at the
# end (memory.PeakMeter), "predicted" the memory model's figure for the same choice.
set -eu -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SITE=${SITE:-/tmp/nanoeuler-site}
WORK=${WORK:-/tmp/nanoeuler-full}
PY=${PYTHON:-python3}
OUT=${OUT:-$WORK/out}
CAPS=${CAPS:-7e9 11e9 22e9}
ROWS="pretrain-fp32 pretrain-bf16 sft-fp32 sft-bf16 ref-logps dpo-fp32 dpo-bf16 hellaswag-eval evaluate sample"
DIR=$WORK/memory
export PYTHONPATH="$REPO:$SITE" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1 NANOEULER_KERNELS=portable

config() {  # the full config with the row's stage cut short: $1 the row, $2 the file
    local prec=${1##*-}
    {
        printf 'device: gpu\ntokenizer: {vocab_size: 4096}\nmodel: {preset: gpu}\n'
        case $1 in
            pretrain-*) printf 'pretrain: {precision: %s, steps: 8, warmup_steps: 2, log_every: 4, eval_every: 8,' "$prec"
                        printf ' checkpoint_every: 8, val_tokens: 32768}\n' ;;
            sft-*) printf 'sft: {precision: %s, epochs: 1, max_examples: 212, val_examples: 21, log_every: 3,' "$prec"
                   printf ' eval_every: 6, checkpoint_every: 1000}\n' ;;
            dpo-*) printf 'dpo: {precision: %s, epochs: 1, val_pairs: 32, log_every: 3, eval_every: 6,' "$prec"
                   printf ' checkpoint_every: 1000}\n' ;;
            *) printf 'eval: {hellaswag_items: 256, val_tokens: 65536, max_new_tokens: 64}\n' ;;
        esac
    } > "$2"
}

stage() {  # $1 the row, $2 its directory: the stage's command line, run in $WORK
    local r=$WORK/results c="--config $2/cfg.yaml"
    case $1 in
        pretrain-*) echo "pretrain $c --shards $r/shards/manifest.json --tokenizer $r/tokenizer.json --out $2/out.bin --run-dir $2/run --no-progress" ;;
        sft-*) echo "sft $c --base $r/base.bin --data $WORK/data/alpaca/alpaca.jsonl --out $2/out.bin --run-dir $2/run --no-progress" ;;
        ref-logps) echo "ref-logps $c --ckpt $r/chat.bin --prefs $DIR/prefs.jsonl --out $DIR/ref_logps.npz --no-progress" ;;
        dpo-*) echo "dpo $c --ckpt $r/chat.bin --prefs $DIR/prefs.jsonl --ref $DIR/ref_logps.npz --out $2/out.bin --run-dir $2/run --no-progress" ;;
        hellaswag-eval) echo "hellaswag-eval $c --ckpt $r/chat.bin --data $WORK/data/hellaswag/hellaswag.jsonl --name chat --out $2/out.json" ;;
        evaluate) echo "evaluate $c --base $r/base.bin --chat $r/chat.bin --shards $r/shards/manifest.json --samples $2/samples.md --metrics $2/metrics.json --plot $2/loss.png --pretrain-dir $2 --sft-dir $2" ;;
        sample) echo "sample $c --ckpt $r/chat.bin --prompt Once --max-new-tokens 256 --temperature 0" ;;
    esac
}

run_row() {  # $1 the row, $2 the cap: one run, one line of rows.tsv
    local dir=$DIR/$1-$2
    rm -rf "$dir" && mkdir -p "$dir"
    config "$1" "$dir/cfg.yaml"
    local t0 t1 rc=0
    t0=$(date +%s.%N)
    (cd "$WORK" && CUPY_GPU_MEMORY_LIMIT=$(printf "%.0f" "$2") $PY -m nanoeuler $(stage "$1" "$dir")) > "$dir/stdout" 2> "$dir/log" || rc=$?
    t1=$(date +%s.%N)
    $PY - "$1" "$2" "$dir" "$rc" "$t0" "$t1" "$DIR/rows.tsv" <<'PY'
import json, re, sys
from pathlib import Path

row, cap, d, rc, t0, t1, table = sys.argv[1:]
log = Path(d, "log").read_text(errors="replace")
peak = re.findall(r"device memory peak ([\d.]+) GB measured, ([\d.]+) GB predicted \(([\d.]+|None)\)(?:; (.*))?", log)
fit = re.findall(r"batch (\d+(?: pairs)?) as (\d+) micro-batches of (\d+)", log)
err = [line for line in log.splitlines() if ": error: " in line]
speed = "-"
metrics = Path(d, "run", "metrics.jsonl")
if metrics.exists():
    rates = [r["tokens_per_s"] for r in map(json.loads, metrics.read_text().splitlines()) if "tokens_per_s" in r]
    speed = f"{rates[-1]:,.0f}" if rates else "-"
elif row == "sample" and rc == "0":
    speed = f"{256 / (float(t1) - float(t0)):,.0f} (with start-up)"
if peak:
    measured, predicted, ratio, detail = peak[-1]
    chosen = f"{fit[-1][2]} of {fit[-1][0]}" if fit else (detail or "-")
elif err:
    measured = predicted = ratio = "-"
    chosen = "refused: " + err[-1].split(": error: ", 1)[1][:120]
else:
    measured = predicted = ratio = "-"
    chosen = f"exit {rc}, see {d}/log"
line = "\t".join([row, f"{float(cap) / 1e9:g} GB", chosen, predicted, measured, ratio, speed])
old = Path(table).read_text().splitlines() if Path(table).exists() else []
key = "\t".join(line.split("\t")[:2]) + "\t"  # a row run again at a cap replaces its line
Path(table).write_text("".join(f"{r}\n" for r in old if not r.startswith(key)) + line + "\n")
PY
    tail -1 "$DIR/rows.tsv"
}

table() {
    mkdir -p "$OUT"
    {
        echo "| stage | cap | micro-batch (or chunk) chosen | predicted peak GB | measured peak GB | measured / predicted | tokens/s |"
        echo "|---|---:|---|---:|---:|---:|---:|"
        sort -t$'\t' -k1,1 -k2,2n "$DIR/rows.tsv" | awk -F'\t' '{printf "| %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7}'
    } | tee "$OUT/memory_table.md"
}

mkdir -p "$DIR"
if [ "${1:-}" = table ]; then table; exit 0; fi
if [ "${1:-}" = config ]; then config "$2" "$3"; exit 0; fi  # one row's config file (tests read it)
for row in ${@:-$ROWS}; do  # every row known before the first run
    case " $ROWS " in *" $row "*) ;; *) echo "unknown row $row (one of: $ROWS)" >&2; exit 2 ;; esac
done
if [ ! -f "$DIR/prefs.jsonl" ] && [ -f "$WORK/data/prefs/prefs.jsonl" ]; then  # 256 train, 32 held out
    head -n 288 "$WORK/data/prefs/prefs.jsonl" > "$DIR/prefs.jsonl"
fi
for row in ${@:-$ROWS}; do
    for cap in $CAPS; do
        run_row "$row" "$cap"
    done
done
table
