#!/usr/bin/env bash
# The training data of the decode benchmark's trained model (`scripts/gen_bench.sh trained`): the
# reStructuredText sources of the Python 3.11 documentation (Debian's python3.11-doc, about 10.8 MB), a
# 4,096-token BPE learned on them, the token shards (about 3M training tokens) and the pretrain config of
# the `gpu` model (116M, 4 MTP heads; 3,000 steps of B16 x T512 in bf16, lr 1e-3).
#
#   scripts/gen_bench_data.sh OUT        then   DATA=OUT scripts/gen_bench.sh trained   (on a GPU machine)
#
# OUT gets gpu.yaml, tok4096.json and shards4096/ (manifest.json, one .npy shard per split), plus the docs
# and corpus parquets the stages read. The .deb comes from $DEBS (default data/mirror-src/debs, where
# scripts/mirror/build.py keeps its downloads) when it holds python3.11-doc_*_all.deb, else from
# `apt-get download`; its unpacked tree under OUT/dl is deleted once the docs parquet is written, so OUT
# stays small enough to copy to the GPU machine. Finished stages are skipped on a re-run; a CPU check
# (2 steps of the `small` model on the same shards and config) runs last.
set -euo pipefail
OUT=$(mkdir -p "${1:?usage: gen_bench_data.sh OUT}" && cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEBS=$(cd "$REPO" && realpath -m "${DEBS:-data/mirror-src/debs}")
PY=${PYTHON:-python3}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
NE="nice -n 10 $PY -m nanoeuler"
cd "$OUT"

# One config drives every stage. corpus: 2% of the 8 KB pieces held out for validation; pretrain: the model
# sees the 3M training tokens about 8 times in 3,000 steps of 8,192 tokens.
cat > gpu.yaml <<'YAML'
device: gpu
corpus: {val_fraction: 0.02, chunk_bytes: 8192, weights: {gutenberg: 1.0, fineweb: 0.0}}
tokenizer: {vocab_size: 4096}
shards: {shard_tokens: 50000000}
model: {preset: gpu, ctx_len: 512, mtp_heads: 4}
pretrain: {precision: bf16, steps: 3000, batch_size: 16, lr: 1.0e-3, min_lr: 1.0e-4, warmup_steps: 100,
           log_every: 50, eval_every: 500, checkpoint_every: 1000, keep_checkpoints: 1, val_tokens: 65536}
YAML

run() {  # run OUTPUT NAME CMD...: the stage NAME, unless OUTPUT exists
    local out=$1 name=$2; shift 2
    if [ -e "$out" ]; then echo "== $name: $out exists, skipped"; else echo "== $name"; "$@"; fi
}
unpack() {  # the .deb from $DEBS or apt-get, unpacked into dl/pydoc
    mkdir -p dl
    local deb
    deb=$(ls "$DEBS"/python3.11-doc_*_all.deb 2>/dev/null | tail -1 || true)
    if [ -z "$deb" ]; then
        (cd dl && apt-get download python3.11-doc)
        deb=$(ls dl/python3.11-doc_*_all.deb | tail -1)
    fi
    echo "$deb"
    rm -rf dl/pydoc && dpkg-deb -x "$deb" dl/pydoc
}
docs() {
    unpack
    nice -n 10 $PY "$REPO/scripts/pydoc_books.py" dl/pydoc docs
    rm -rf dl  # the unpacked HTML tree is most of OUT otherwise; the parquet holds every source
}
run docs/books.parquet docs docs
run corpus/val.parquet corpus $NE corpus --config gpu.yaml --books docs/books.parquet --web docs/web.parquet \
    --train corpus/train.parquet --val corpus/val.parquet
run tok4096.json tokenizer $NE tokenizer --config gpu.yaml --corpus corpus/train.parquet --out tok4096.json
run shards4096/manifest.json tokenize $NE tokenize --config gpu.yaml --tokenizer tok4096.json --workers 2 \
    --train corpus/train.parquet --val corpus/val.parquet --out shards4096/manifest.json

# The check: gpu.yaml's sections as `nanoeuler pretrain` reads them, with the model, precision and steps
# made small enough for the CPU; the shards and tokenizer are the real ones.
echo "== check: 2 CPU steps of the small model"
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
params=$($PY - <<'PY'
import json
from nanoeuler.config import load_config, params_json
conf = load_config("gpu.yaml")
conf["model"]["preset"] = "small"
conf["pretrain"].update(precision="fp32", steps=2, eval_every=2, log_every=1, val_tokens=4096)
print(params_json(conf, "model", "pretrain"))
PY
)
$NE pretrain --params "$params" --device cpu --shards shards4096/manifest.json --tokenizer tok4096.json \
    --out "$check/base.bin" --no-progress | tail -1

echo "== sizes"
$PY - <<'PY'
import json
import pyarrow.parquet as pq
text = sum(len(t.encode()) for t in pq.read_table("docs/books.parquet", columns=["text"]).column("text").to_pylist())
print(f"text: {text:,} bytes of reStructuredText")
for name, split in json.load(open("shards4096/manifest.json"))["splits"].items():
    print(f"shards4096 {name}: {split['tokens']:,} tokens from {split['bytes']:,} bytes "
          f"({split['bytes'] / split['tokens']:.2f} bytes/token), {split['documents']:,} documents")
PY
for path in shards4096 tok4096.json docs corpus "$OUT"; do  # one du each: du counts a file once over its arguments
    du -sh --apparent-size "$path" | sed 's/^/size: /'
done
