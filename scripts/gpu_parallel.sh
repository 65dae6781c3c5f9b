#!/usr/bin/env bash
# Data-parallel checks and timings on the GPUs of this host, in one go (N = every visible GPU, or $GPUS):
#   1. identity: at world size 1 the NCCL average leaves the gradients bit for bit unchanged (fp32: the flat
#      reduce-scatter and all-gather; the bf16 engine's flat buffer: the all-reduce), and training through
#      the NCCL path agrees with the plain path as closely as two plain runs do (bench/parallel_gpu.py identity),
#   2. the NCCL all-reduce of the 116M gradient buffer at world 1 and N,
#   3. `nanoeuler pretrain` N ranks x B against 1 GPU x N*B for $STEPS steps (default 100), fp32 and bf16,
#      on random-token shards: the largest relative loss difference (fp32 <= 1e-5, bf16 <= 2e-2). With one
#      GPU the "N ranks" run is one rank launched as RANK=0 WORLD_SIZE=1 (the NCCL path),
#   4. kill one rank (N >= 2): `kill -9` of rank N-1 after the second checkpoint; the launcher must stop the
#      run with a message naming it, and the same command must resume from the last checkpoint and finish,
#   5. scaling: tokens/s of 1, 2, 4, 8 ranks (up to N) at B16xT512 and B32xT512 per GPU, and the efficiency
#      against one GPU's plain engine,
# then prints a summary table last. Logs go to $LOG_DIR (default $TMPDIR/nanoeuler-gpu-parallel).
#
#   bash scripts/gpu_parallel.sh zero      # ZeRO-1 instead (~4 min): on 2 and 4 GPUs (up to N), `nanoeuler
#       pretrain` fp32 with zero 0 and zero 1 for $STEPS steps: every logged loss and norm and the final
#       model equal bit for bit (both average through the same flat reduce-scatter, so NCCL adds every
#       element in the same order on any number of GPUs); a checkpoint of 2 ranks resumed on 4; rank 0's
#       optimizer state and the measured peak of the 116M model at fp32, zero 0 against zero 1
#   bash scripts/gpu_parallel.sh zerobf16  # ZeRO-1 on the bf16 engine (~5 min): on 2 and 4 GPUs (up to N), `nanoeuler
#       pretrain` bf16 with zero 0 and zero 1 for $STEPS steps: the largest relative loss difference (<= 2e-2) and
#       the final weights' (within 4x what two zero-0 runs differ by, or 1e-3: the engine's embedding backward
#       adds with atomics, so no two runs agree bit for bit); a checkpoint of 2 ranks resumed on 4; rank 0's
#       optimizer state and the measured peak of the 116M model at bf16, zero 0 against zero 1
#   bash scripts/gpu_parallel.sh twonode   # two "nodes" on this host (~4 min): N ranks in two launcher groups
#       of N/2, started as srun would (RANK/WORLD_SIZE/LOCAL_RANK, the id over TCP at MASTER_ADDR:MASTER_PORT),
#       NCCL kept off NVLink and shared memory (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): N x B against 1 x N*B
#       (fp32, bf16), and the all-reduce of the 116M gradients over sockets against NVLink
# Exit status: non-zero when any check failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nanoeuler-gpu-parallel}
STEPS=${STEPS:-100}
N=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nanoeuler-dp-XXXXXX")
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
unset CUPY_TF32
[ "$N" -ge 1 ] || { echo "no GPU found"; exit 1; }
echo "=== $N GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"

MODE=${1:-all}
names=() results=()
record() { names+=("$1"); if [ "$2" -eq 0 ]; then results+=("ok${3:+: $3}"); else results+=("FAIL${3:+: $3}"); fi; }
summary() {
    echo
    printf '%-44s %s\n' "check" "result"
    local fail=0 i
    for i in "${!names[@]}"; do
        printf '%-44s %s\n' "${names[$i]}" "${results[$i]}"
        case ${results[$i]} in FAIL*) fail=1 ;; esac
    done
    rm -rf "$WORK"
    exit $fail
}
make_shards() {
    PYTHONPATH=$PWD/tests:$PYTHONPATH $PY - "$WORK" <<'EOF' || exit 1
import sys
from pathlib import Path
from train_fixtures import make_tokenizer, write_shards
work = Path(sys.argv[1])
tok = make_tokenizer()
tok.save(work / "tok.json")
write_shards(work / "shards", tok, n_train=400_000, n_val=20_000, shard_tokens=100_000)
EOF
}
conf() {  # conf FILE PRECISION BATCH [STEPS [EXTRA]]
    cat > "$1" <<EOF
device: gpu
model: {dim: 256, n_layers: 2, n_heads: 4, n_kv_heads: 2, ctx_len: 128, mtp_heads: 2}
pretrain: {precision: $2, batch_size: $3, steps: ${4:-$STEPS}, lr: 1.0e-3, warmup_steps: 10, log_every: 1,
           eval_every: 100000, checkpoint_every: 25, keep_checkpoints: 20, val_tokens: 1024${5:+, $5}}
EOF
}
pretrain() {  # pretrain CONFIG RUN_DIR [ARGS...]
    local c=$1 d=$2; shift 2
    $PY -m nanoeuler pretrain --config "$c" --shards "$WORK/shards/manifest.json" --tokenizer "$WORK/tok.json" \
        --out "$d/base.bin" --run-dir "$d" --no-progress "$@"
}
compare_runs() {  # compare_runs RUN_A RUN_B LIMIT|exact [BASELINE_B]: every logged step's loss (exact: and norm,
    # and the final models; where they differ, pass only if two plain runs A and BASELINE_B differ too, by as much)
    $PY - "$@" <<'EOF'
import json, sys
import numpy as np
from nanoeuler import checkpoint
a, b, how = sys.argv[1:4]
base = sys.argv[4] if len(sys.argv) > 4 else None

def logged(d):
    return [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"loss"' in l]

def rel(la, lb):
    assert len(la) == len(lb) > 0, (len(la), len(lb))
    return max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(la, lb))

la, lb = logged(a), logged(b)
if how != "exact":
    r = rel(la, lb)
    print(f"max rel loss diff {r:.3g} over {len(la)} steps (limit {float(how):g})")
    sys.exit(0 if r <= float(how) else 1)
same = [(x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"]) for x, y in zip(la, lb)]
ta, tb = (checkpoint.load(f"{d}/base.bin")[0] for d in (a, b))
diff = [n for n in ta if not np.array_equal(ta[n], tb[n])]
line = f"{sum(same)} of {len(la)} steps equal (loss, norm), {len(ta) - len(diff)} of {len(ta)} final tensors"
if all(same) and not diff:
    print(line + ": bit for bit")
    sys.exit(0)
r, r0 = rel(la, lb), rel(la, logged(base)) if base else float("inf")
print(f"{line}; max rel loss diff {r:.3g}, two plain runs {r0:.3g}")
sys.exit(0 if base and r0 > 0 and r <= 2 * r0 else 1)  # a path whose own runs differ: as much as they do
EOF
}

# ---- ZeRO-1: against the unsharded run (fp32: bit for bit), resume on another world, optimizer memory ----
compare_weights() {  # compare_weights RUN_A RUN_B BASELINE_B: the losses, and the final weights of B against A
    # beside those of a second plain run BASELINE_B (max over tensors of |b - a| / |a|, Frobenius norms)
    $PY - "$@" <<'EOF'
import json, sys
import numpy as np
from nanoeuler import checkpoint
a, b, base = sys.argv[1:4]
logs = [[json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"loss"' in l] for d in (a, b)]
assert len(logs[0]) == len(logs[1]) > 0, [len(x) for x in logs]
loss = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(*logs))
ta, tb, t0 = (checkpoint.load(f"{d}/base.bin")[0] for d in (a, b, base))

def rel(tx):
    return max(float(np.linalg.norm(tx[n] - ta[n]) / np.linalg.norm(ta[n])) for n in ta)

got, plain = rel(tb), rel(t0)
print(f"max rel loss diff {loss:.3g} over {len(logs[0])} steps; weights {got:.3g} (two zero-0 runs {plain:.3g})")
sys.exit(0 if loss <= 2e-2 and got <= max(4 * plain, 1e-3) else 1)
EOF
}
zero_checks() {  # zero_checks PRECISION: the checks of `zero` (fp32) or `zerobf16` (bf16), then the summary
    local prec=$1 mem_b=4 resume_limit=1e-5 n z rc out
    [ "$STEPS" -gt 25 ] || { echo "the zero checks need STEPS > 25: the resume check starts from step 25's checkpoint"; exit 2; }
    [ "$prec" = bf16 ] && mem_b=16 resume_limit=2e-2
    make_shards
    B=8
    for n in $(printf '%s\n' 2 4 | awk -v n="$N" '$1 <= n'); do
        rc=0
        for z in 0 1; do
            conf "$WORK/$prec-z$z-$n.yaml" "$prec" $B "$STEPS" "zero: $z"
            pretrain "$WORK/$prec-z$z-$n.yaml" "$WORK/$prec-z$z-$n" --gpus "$n" \
                > "$LOG_DIR/$prec-zero$z-$n.log" 2>&1 || rc=1
        done
        pretrain "$WORK/$prec-z0-$n.yaml" "$WORK/$prec-again-$n" --gpus "$n" \
            > "$LOG_DIR/$prec-zero0-again-$n.log" 2>&1 || rc=1
        if [ "$prec" = fp32 ]; then  # fixed order, one flat reduce-scatter in both: every step and tensor, bit for bit
            out=$(compare_runs "$WORK/$prec-z0-$n" "$WORK/$prec-z1-$n" exact "$WORK/$prec-again-$n") || rc=1
        else  # the engine's embedding backward adds with atomics: as close as two zero-0 runs
            out=$(compare_weights "$WORK/$prec-z0-$n" "$WORK/$prec-z1-$n" "$WORK/$prec-again-$n") || rc=1
        fi
        record "$prec zero 1 vs 0, $n GPUs x B$B" "$rc" "$out"
    done
    if [ "$N" -ge 4 ]; then  # 2 ranks x 2B to step 25, then 4 ranks x B from its checkpoint: the global batch stays
        conf "$WORK/$prec-r2.yaml" "$prec" $((2 * B)) "$STEPS" "zero: 1"
        conf "$WORK/$prec-r4.yaml" "$prec" $B "$STEPS" "zero: 1"
        pretrain "$WORK/$prec-r2.yaml" "$WORK/$prec-r" --gpus 2 > "$LOG_DIR/$prec-resume2.log" 2>&1
        pretrain "$WORK/$prec-r2.yaml" "$WORK/$prec-whole2" --gpus 2 > "$LOG_DIR/$prec-whole2.log" 2>&1
        find "$WORK/$prec-r" -name 'ckpt_*.bin' ! -name 'ckpt_00000025.bin' -delete
        rm -f "$WORK/$prec-r/base.bin"
        pretrain "$WORK/$prec-r4.yaml" "$WORK/$prec-r" --gpus 4 > "$LOG_DIR/$prec-resume4.log" 2>&1; rc=$?
        grep -q "resuming from step 25" "$LOG_DIR/$prec-resume4.log" || rc=1
        out=$(compare_runs "$WORK/$prec-whole2" "$WORK/$prec-r" "$resume_limit") || rc=1
        record "$prec zero: 2 ranks' checkpoint resumed on 4" "$rc" \
            "$(grep -o 'resuming from step [0-9]*' "$LOG_DIR/$prec-resume4.log"); $out"
    fi
    n=$(( N >= 4 ? 4 : N ))
    for z in 0 1; do  # the 116M model, B x T512: what rank 0 holds and the measured peak
        cat > "$WORK/$prec-m$z.yaml" <<EOF
device: gpu
model: {preset: gpu}
pretrain: {precision: $prec, batch_size: $mem_b, steps: 10, log_every: 5, eval_every: 100000,
           checkpoint_every: 100000, val_tokens: 2048, zero: $z}
EOF
        pretrain "$WORK/$prec-m$z.yaml" "$WORK/$prec-m$z" --gpus "$n" > "$LOG_DIR/$prec-mem$z.log" 2>&1; rc=$?
        record "116M $prec B$mem_b, $n GPUs, zero $z: rank 0" "$rc" \
            "$(grep -o 'keeps.*unsharded)' "$LOG_DIR/$prec-mem$z.log") $(grep -o 'device memory peak.*' "$LOG_DIR/$prec-mem$z.log")"
    done
    summary
}
[ "$MODE" = zero ] && zero_checks fp32
[ "$MODE" = zerobf16 ] && zero_checks bf16

# ---- two "nodes" on this host: NCCL over its network transport ----
if [ "$MODE" = twonode ]; then
    [ "$N" -ge 2 ] || { echo "twonode needs 2 GPUs or more"; exit 1; }
    make_shards
    B=8
    port=$((20000 + RANDOM % 20000))
    groups() {  # groups CONFIG RUN_DIR: ranks 0..N/2-1 and N/2..N-1, two groups started as srun starts tasks
        local pids=() r rc=0
        for r in $(seq 0 $((N - 1))); do
            RANK=$r WORLD_SIZE=$N LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
                NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 pretrain "$1" "$2" > "$LOG_DIR/node$((2 * r / N))-rank$r.log" 2>&1 &
            pids+=($!)
        done
        for r in "${pids[@]}"; do wait "$r" || rc=1; done
        port=$((port + 1))
        return $rc
    }
    for prec in fp32 bf16; do
        conf "$WORK/one-$prec.yaml" "$prec" $((N * B)); conf "$WORK/dp-$prec.yaml" "$prec" $B
        pretrain "$WORK/one-$prec.yaml" "$WORK/one-$prec" > "$LOG_DIR/one-$prec.log" 2>&1; rc=$?
        groups "$WORK/dp-$prec.yaml" "$WORK/dp-$prec" || rc=1
        limit=$([ $prec = fp32 ] && echo 1e-5 || echo 2e-2)
        out=$(compare_runs "$WORK/one-$prec" "$WORK/dp-$prec" $limit) || rc=1
        record "2 nodes: $N x B$B vs 1 x B$((N * B)), $prec" "$rc" "$out"
    done
    $PY bench/parallel_gpu.py --ranks "$N" allreduce 2>&1 | tee "$LOG_DIR/allreduce-nvlink.log"
    record "all-reduce 116M, $N GPUs, NVLink" "${PIPESTATUS[0]}" "$(grep -o 'median.*' "$LOG_DIR/allreduce-nvlink.log")"
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 $PY bench/parallel_gpu.py --ranks "$N" allreduce 2>&1 \
        | tee "$LOG_DIR/allreduce-net.log"
    record "all-reduce 116M, $N GPUs, sockets" "${PIPESTATUS[0]}" "$(grep -o 'median.*' "$LOG_DIR/allreduce-net.log")"
    summary
fi

# ---- 1, 2: the world-1 identity and the all-reduce ----
$PY bench/parallel_gpu.py --ranks 1 identity 2>&1 | tee "$LOG_DIR/identity.log"
record "world 1: NCCL path vs plain path" "${PIPESTATUS[0]}" \
    "all-reduce unchanged on $(grep -c 'bit for bit unchanged' "$LOG_DIR/identity.log") of 2 gradient sets"
for n in $(printf '%s\n' 1 "$N" | sort -un); do
    $PY bench/parallel_gpu.py --ranks "$n" allreduce 2>&1 | tee "$LOG_DIR/allreduce$n.log"
    record "all-reduce 116M, world $n" "${PIPESTATUS[0]}" "$(grep -o 'median.*' "$LOG_DIR/allreduce$n.log")"
done

# ---- 3: N ranks x B against 1 x N*B through `nanoeuler pretrain` ----
make_shards
B=8
for prec in fp32 bf16; do
    conf "$WORK/one-$prec.yaml" "$prec" $((N * B)); conf "$WORK/dp-$prec.yaml" "$prec" $B
    pretrain "$WORK/one-$prec.yaml" "$WORK/one-$prec" > "$LOG_DIR/one-$prec.log" 2>&1; rc=$?
    if [ "$N" -gt 1 ]; then
        pretrain "$WORK/dp-$prec.yaml" "$WORK/dp-$prec" --gpus "$N" > "$LOG_DIR/dp-$prec.log" 2>&1 || rc=1
    else
        RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 NANOEULER_RENDEZVOUS="$WORK/nccl.id" \
            pretrain "$WORK/dp-$prec.yaml" "$WORK/dp-$prec" > "$LOG_DIR/dp-$prec.log" 2>&1 || rc=1
    fi
    diff=$($PY - "$WORK/one-$prec/metrics.jsonl" "$WORK/dp-$prec/metrics.jsonl" "$prec" "$N" <<'EOF'
import json, sys
one, dp = ([json.loads(l) for l in open(p) if '"loss"' in l] for p in sys.argv[1:3])
prec, n = sys.argv[3], int(sys.argv[4])
assert len(one) == len(dp) > 0, (len(one), len(dp))
rel = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one, dp))
limit = 1e-5 if prec == "fp32" else 2e-2  # N x B adds in another order than 1 x N*B (bf16: atomics too)
print(f"max rel loss diff {rel:.3g} over {len(one)} steps (limit {limit:g})")
sys.exit(0 if rel <= limit else 1)
EOF
)
    [ $? -eq 0 ] || rc=1
    record "pretrain $N x B$B vs 1 x B$((N * B)), $prec" "$rc" "$diff"
done

# ---- 4: kill one rank, then resume ----
if [ "$N" -gt 1 ]; then
    conf "$WORK/kill.yaml" bf16 $B 3000
    $PY -m nanoeuler pretrain --config "$WORK/kill.yaml" --shards "$WORK/shards/manifest.json" \
        --tokenizer "$WORK/tok.json" --out "$WORK/kill/base.bin" --run-dir "$WORK/kill" --no-progress \
        --gpus "$N" > "$LOG_DIR/kill.log" 2>&1 &
    launcher=$!  # the launcher; its children are the ranks, started in rank order
    for _ in $(seq 1500); do [ -e "$WORK/kill/ckpt_00000050.bin" ] && break; sleep 0.2; done
    victim=$(pgrep -P "$launcher" | sort -n | tail -1)
    kill -9 "$victim"
    wait "$launcher"; krc=$?
    ok=1
    [ "$krc" -ne 0 ] && grep -q "rank $((N - 1)) (pid $victim) was killed by SIGKILL" "$LOG_DIR/kill.log" && ok=0
    pretrain "$WORK/kill.yaml" "$WORK/kill" --gpus "$N" > "$LOG_DIR/resume.log" 2>&1 || ok=1
    grep -q "resuming from step" "$LOG_DIR/resume.log" || ok=1
    record "kill rank $((N - 1)), resume" "$ok" "$(grep -o 'resuming from step [0-9]*' "$LOG_DIR/resume.log")"
fi

# ---- 5: scaling ----
worlds=$(printf '%s\n' 1 2 4 8 | awk -v n="$N" '$1 <= n')
for n in $worlds; do
    $PY bench/parallel_gpu.py --ranks "$n" scale --rows 16x512,32x512 --json "$LOG_DIR/scale$n.json" 2>&1 \
        | tee "$LOG_DIR/scale$n.log"
    record "scale, world $n" "${PIPESTATUS[0]}"
done
$PY - "$LOG_DIR" $worlds <<'EOF' | tee "$LOG_DIR/scaling.txt"
import json, sys
from pathlib import Path
d, worlds = Path(sys.argv[1]), [int(w) for w in sys.argv[2:]]
rows = [r for w in worlds if (d / f"scale{w}.json").exists() for r in json.loads((d / f"scale{w}.json").read_text())]
base = {(r["B"], r["T"]): r["tokens_per_s"] for r in rows if r["world"] == 1 and r["mode"] == "plain"}
print(f"\n{'GPUs':>4} {'per GPU':<9} {'mode':<13} {'ms/step':>8} {'tokens/s':>12} {'x 1 GPU':>7} {'efficiency':>10}")
for r in rows:
    one = base.get((r["B"], r["T"]))
    x = r["tokens_per_s"] / one if one else float("nan")
    print(f"{r['world']:>4} B{r['B']}xT{r['T']:<5} {r['mode']:<13} {r['ms']:>8.2f} {r['tokens_per_s']:>12,.0f} "
          f"{x:>7.2f} {x / r['world']:>10.1%}")
EOF

summary
