#!/usr/bin/env bash
# DPO on real preference pairs, on the CPU: a `small`-sized chat model trained on the Python 3.11
# documentation (Debian's python3.11-doc, reStructuredText sources) and LLaMA-Factory's Alpaca demo set,
# then DPO on LLaMA-Factory's 300-pair dpo_en_demo.json, held-out pairs scored before and after.
#
#   bash scripts/dpo_real_data.sh WORKDIR            (needs `pip download` and `apt-get download`)
#
# Every stage is the `nanoeuler` CLI; WORKDIR holds the downloads, the config, data/ and results/.
set -euo pipefail
WORK=$(mkdir -p "${1:?usage: dpo_real_data.sh WORKDIR}" && cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$WORK"
mkdir -p dl data/corpus results logs

if [ ! -f dl/llamafactory-0.9.5/data/dpo_en_demo.json ]; then
  pip download -q --no-deps --no-binary :all: llamafactory==0.9.5 -d dl
  tar xzf dl/llamafactory-0.9.5.tar.gz -C dl llamafactory-0.9.5/data/dpo_en_demo.json \
      llamafactory-0.9.5/data/alpaca_en_demo.json
fi
if [ ! -d dl/pydoc ]; then
  (cd dl && apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*_all.deb pydoc)
fi

# The docs as "books" (one document per .rst source); no web text (corpus.weights.fineweb: 0).
[ -f data/books.parquet ] || python "$REPO/scripts/pydoc_books.py" dl/pydoc data

cat > config.yaml <<YAML
device: cpu
alpaca: {url: dl/llamafactory-0.9.5/data/alpaca_en_demo.json, delay_s: 0}
corpus: {val_fraction: 0.02, chunk_bytes: 8192, weights: {gutenberg: 1.0, fineweb: 0.0}}
tokenizer: {vocab_size: 1024}
shards: {shard_tokens: 1000000}
model: {preset: small, ctx_len: 128, mtp_heads: 1}
pretrain: {steps: ${PRETRAIN_STEPS:-150}, batch_size: 8, lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 15,
           log_every: 10, eval_every: 100, checkpoint_every: 50, val_tokens: 16384}
sft: {epochs: 1, batch_size: 8, max_examples: 450, lr: 1.0e-3, min_lr: 1.0e-4, warmup_steps: 10, log_every: 5,
      eval_every: 25, checkpoint_every: 25, val_examples: 40}
prefs: {format: sharegpt, url: dl/llamafactory-0.9.5/data/dpo_en_demo.json, delay_s: 0}
dpo: {epochs: ${DPO_EPOCHS:-4}, batch_size: 8, lr: 3.0e-5, min_lr: 3.0e-6, warmup_steps: 2, beta: 0.1,
      val_pairs: 60, log_every: 5, eval_every: 30, checkpoint_every: 40}
YAML

NE="nice -n 10 nanoeuler"
run() { local name=$1; shift; if [ ! -e "${name%%:*}" ]; then echo "== ${name#*:}"; "$@"; fi; }
run data/corpus/val.parquet:corpus $NE corpus --config config.yaml --books data/books.parquet \
    --web data/web.parquet --train data/corpus/train.parquet --val data/corpus/val.parquet
run results/tokenizer.json:tokenizer $NE tokenizer --config config.yaml --corpus data/corpus/train.parquet \
    --out results/tokenizer.json
run results/shards/manifest.json:tokenize $NE tokenize --config config.yaml --tokenizer results/tokenizer.json \
    --workers 2 --train data/corpus/train.parquet --val data/corpus/val.parquet --out results/shards/manifest.json
run results/base.bin:pretrain $NE pretrain --config config.yaml --shards results/shards/manifest.json \
    --tokenizer results/tokenizer.json --out results/base.bin --no-progress
run data/alpaca.jsonl:alpaca $NE alpaca --config config.yaml --out data/alpaca.jsonl --raw-dir data/alpaca_raw
run results/chat.bin:sft $NE sft --config config.yaml --base results/base.bin --data data/alpaca.jsonl \
    --out results/chat.bin --no-progress
if [ "${STOP_AFTER_SFT:-0}" = 1 ]; then exit 0; fi
run data/prefs.jsonl:prefs $NE prefs --config config.yaml --out data/prefs.jsonl --raw-dir data/prefs_raw
run results/ref_logps.npz:ref-logps $NE ref-logps --config config.yaml --ckpt results/chat.bin \
    --prefs data/prefs.jsonl --out results/ref_logps.npz
run results/dpo.bin:dpo $NE dpo --config config.yaml --ckpt results/chat.bin --prefs data/prefs.jsonl \
    --ref results/ref_logps.npz --out results/dpo.bin --no-progress
