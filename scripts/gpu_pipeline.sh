#!/usr/bin/env bash
# The compute stages on a GPU through the CLI, once per precision: pretrain the 116M `gpu` preset for a
# few steps on existing shards, fine-tune it on Alpaca, sample from it; then a table of final losses.
# Needs the outputs of `make demo` (results/shards, results/tokenizer.json, data/alpaca/alpaca.jsonl) and
# a machine with CuPy; runs from the source tree. Usage: bash scripts/gpu_pipeline.sh [STEPS]
set -eu -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=${1:-60}
WORK=${WORK:-${TMPDIR:-/tmp}/nanoeuler-gpu-pipeline}
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
summary=()
for precision in fp32 bf16; do
    conf="$WORK/$precision.yaml"
    cat > "$conf" <<YAML
device: gpu
model: {preset: gpu}
pretrain: {steps: $STEPS, batch_size: 16, warmup_steps: 10, lr: 6.0e-4, min_lr: 6.0e-5, log_every: 10,
           eval_every: $STEPS, checkpoint_every: $((STEPS / 2)), val_tokens: 4096, precision: $precision}
sft: {epochs: 1, batch_size: 16, warmup_steps: 2, log_every: 2, eval_every: 1000, checkpoint_every: 1000,
      val_examples: 8, precision: $precision}
YAML
    t0=$SECONDS
    $PY -m nanoeuler pretrain --config "$conf" --shards results/shards/manifest.json \
        --tokenizer results/tokenizer.json --out "$WORK/$precision/base.bin" --no-progress 2>&1 | tail -2
    t1=$SECONDS
    $PY -m nanoeuler sft --config "$conf" --base "$WORK/$precision/base.bin" --data data/alpaca/alpaca.jsonl \
        --out "$WORK/$precision/chat.bin" --no-progress 2>&1 | tail -2
    t2=$SECONDS
    $PY -m nanoeuler sample --ckpt "$WORK/$precision/chat.bin" --device gpu --prompt "It was" \
        --max-new-tokens 16 --seed 1 2>&1 | tail -1
    last=$(grep '"val_loss"' "$WORK/$precision/pretrain/metrics.jsonl" | tail -1)
    summary+=("$(printf '%-6s pretrain %3ss  sft %3ss  %s' "$precision" $((t1 - t0)) $((t2 - t1)) "$last")")
done
echo
echo "=== gpu-pipeline summary ($STEPS pretraining steps of the 116M preset, B16 x T512)"
printf '%s\n' "${summary[@]}"
