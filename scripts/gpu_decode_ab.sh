#!/usr/bin/env bash
# The decode engine of another rev against this tree's on one GPU, in one go (under 5 minutes on an H100):
# bench/decode_ab_gpu.py for the two sides in turn, ROUNDS times (default 5: every figure a median of
# medians, the sides interleaved so that clocks and neighbours affect both alike; the first round of each
# compiles into an empty CuPy cache, timed as the cold compile), then a table: the batch-1 step, the verify
# pass, batches 16, 32 and 64, prefills, the kernels of a step, and whether greedy and speculative outputs are the
# same token for token. (scripts/decode_resources.py compares the kernels' registers without a GPU.)
#   scripts/gpu_decode_ab.sh [REV]                 # the rev's package by git archive (default: main)
#   BASELINE=<dir> scripts/gpu_decode_ab.sh        # a tree that holds the baseline's nanoeuler/ (no git)
# Without git on the GPU machine, make the baseline beside the checkout first:
#   mkdir -p .carry/base && git archive <rev> nanoeuler | tar -x -C .carry/base
# and carry .carry/base (BASELINE=.carry/base).
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ROUNDS=${ROUNDS:-5}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/decode-ab.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [ -n "${BASELINE:-}" ]; then
    OLD=$(cd "$BASELINE" && pwd)
else
    REV=${1:-main}
    OLD=$WORK/old
    mkdir -p "$OLD"
    git archive "$REV" nanoeuler | tar -x -C "$OLD" || { echo "gpu_decode_ab: git archive $REV failed"; exit 2; }
fi
NEW=$PWD
[ -d "$OLD/nanoeuler" ] || { echo "gpu_decode_ab: $OLD has no nanoeuler/"; exit 2; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
side() {  # side NAME TREE [--cold]: one round, its JSON line appended to $WORK/NAME.jsonl
    local name=$1 tree=$2; shift 2
    CUPY_CACHE_DIR=$WORK/cache-$name PYTHONPATH=$tree timeout 240 \
        $PY bench/decode_ab_gpu.py --params "$WORK/params.npz" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "gpu_decode_ab: $name failed (rc $rc):"; tail -20 "$WORK/$name.err"; exit 1
    fi
    tail -1 "$WORK/$name.out" >> "$WORK/$name.jsonl"
}
$PY -c "import sys; sys.path.insert(0, '$NEW')
from nanoeuler.model import transformer; from nanoeuler.model.config import ModelConfig; import numpy as np
np.savez('$WORK/params.npz', **transformer.init_params(ModelConfig.named('gpu'), seed=0))" || exit 1
for r in $(seq 1 "$ROUNDS"); do  # round 1 compiles into each side's empty cache (the cold build)
    cold=(); [ "$r" -eq 1 ] && cold=(--cold)
    if [ $((r % 2)) -eq 1 ]; then side old "$OLD" "${cold[@]}"; side new "$NEW" "${cold[@]}"
    else side new "$NEW"; side old "$OLD"; fi
    echo "round $r of $ROUNDS done"
done
$PY - "$WORK" <<'PY'
import json, statistics, sys
work = sys.argv[1]
runs = {s: [json.loads(l) for l in open(f"{work}/{s}.jsonl")] for s in ("old", "new")}
def med(side, key):
    return statistics.median(r[key] for r in runs[side] if not r["cold"] or key != "build_s")
rows = [("decode step, batch 1 (us)", "step_us"), ("verify pass, 4 rows x 4 heads (us)", "verify_us"),
        ("decode step, batch 16 (us)", "batch16_us"), ("decode step, batch 32 (us)", "batch32_us"),
        ("decode step, batch 64 (us)", "batch64_us"), ("prefill 16 tokens (ms)", "prefill16_ms"),
        ("prefill 128 tokens (ms)", "prefill128_ms"), ("prefill 512 tokens (ms)", "prefill512_ms")]
same = {k: all(r[k] == runs["old"][0][k] for r in runs["old"] + runs["new"]) for k in ("greedy", "speculative")}
spec_eq_plain = all(r["speculative"] == r["greedy"] for r in runs["old"] + runs["new"])
print(f"\nmedians of {len(runs['old'])} interleaved rounds (each a median of 5), random gpu-preset weights, bf16")
print("| measure | old | new | new / old |")
print("|---|---:|---:|---:|")
for label, key in rows:
    o, n = med("old", key), med("new", key)
    print(f"| {label} | {o:.3f} | {n:.3f} | {n / o:.3f} |")
for label, key in (("kernels a decode step (graph nodes)", "step_kernels"), ("kernels a verify pass", "verify_kernels"),
                   ("kernels a batch-64 step (with cuBLAS's)", "batch64_nodes")):
    print(f"| {label} | {runs['old'][0][key]} | {runs['new'][0][key]} | |")
cold = {s: next(r["build_s"] for r in runs[s] if r["cold"]) for s in runs}
warm = {s: med(s, "build_s") for s in runs}
print(f"| cold compile + build (s) | {cold['old']:.1f} | {cold['new']:.1f} | {cold['new'] / cold['old']:.2f} |")
print(f"| warm build, cached (s) | {warm['old']:.2f} | {warm['new']:.2f} | |")
print(f"| greedy outputs identical (every round, both sides) | {same['greedy']} | | |")
print(f"| speculative outputs identical (every round, both sides) | {same['speculative']} | | |")
print(f"| speculative equals plain greedy | {spec_eq_plain} | | |")
PY
