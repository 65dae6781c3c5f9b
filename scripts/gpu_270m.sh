#!/usr/bin/env bash
# The ~270M `gpu-270m` preset on one GPU, in one go (~6 min on an H100):
#   1. `nanoeuler selftest` (every kernel against NumPy),
#   2. at the preset's layer shapes (1152 wide, 18/6 heads of 64, hidden 3072, vocab 4096, K 4; two layers,
#      B2 x T512): the float32 GPU ops' loss and every gradient against float64 on the CPU (threshold 1e-5,
#      as `gradcheck --device gpu`), and the bf16 engine's (threshold 1e-2, as selftest's engine rows) with
#      the variants it picks on this card,
#   3. the whole preset's engine at B32 x T512: its buffers (`TrainEngine.nbytes`) against the memory model
#      (`plan.engine_bytes`), and what the model picks on a 12 GB card,
#   4. a timed training step against torch.compile of the identical architecture (bench/train_gpu.py;
#      needs torch; target >= 1.4x),
# then prints a summary table last. Logs go to $LOG_DIR (default $TMPDIR/nanoeuler-gpu-270m).
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nanoeuler-gpu-270m}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset CUPY_TF32
names=() results=()
run() {  # run NAME LOG NOTE-REGEX -- CMD...
    local name=$1 log=$2 note=$3; shift 4
    echo "=== $name"
    "$@" 2>&1 | tee "$LOG_DIR/$log"
    local rc=${PIPESTATUS[0]}
    names+=("$name")
    results+=("$([ "$rc" -eq 0 ] && echo ok || echo FAIL): $(grep -oE "$note" "$LOG_DIR/$log" | tail -1)")
}

run "selftest" selftest.log "[0-9]+ of [0-9]+ passed.*" -- $PY -m nanoeuler selftest

run "gradients at the 270M shapes" grads.log "worst.*" -- $PY - <<'EOF'
import dataclasses, sys
import cupy, numpy as np
from nanoeuler.checks import gradcheck_gpu
from nanoeuler.checks.selftest_bf16 import _engine_problem
from nanoeuler.kernels.bf16.engine import TrainEngine
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig

cfg = dataclasses.replace(ModelConfig.named("gpu-270m"), n_layers=2)  # every layer shape, two layers
B, T = 2, 512
loss_err, rows = gradcheck_gpu.compare(cfg, B, T, seed=0)
fp32 = max([loss_err] + [e for _, _, e in rows])
print(f"fp32 GPU ops vs float64: loss {loss_err:.2e}, worst tensor {max(rows, key=lambda r: r[2])[0]} {fp32:.2e}")
params, x, y = _engine_problem(np.random.default_rng(0), cfg, B, T)
eng = TrainEngine(cfg, params, batch=B, seq=T)
eng.forward_backward(x.astype(np.int32), y.astype(np.int32))
loss_ref, g_ref = transformer.loss_and_grads({n: p.astype(np.float64) for n, p in params.items()}, x, y, cfg)
got = {n: g.get().astype(np.float64) for n, g in eng.grads().items()}
errs = {n: np.linalg.norm(got[n] - g_ref[n]) / max(np.linalg.norm(g_ref[n]), 1e-30) for n in got}
allg = np.linalg.norm(np.concatenate([(got[n] - g_ref[n]).ravel() for n in got])) / \
    np.linalg.norm(np.concatenate([g_ref[n].ravel() for n in got]))
lerr = abs(eng.last_loss() - loss_ref) / abs(loss_ref)
print(f"bf16 engine ({eng.attention} attention, fused SwiGLU {eng.fuse_swiglu}, fused RoPE {eng.fuse_rope}) vs "
      f"float64: loss {lerr:.2e}, all gradients {allg:.2e}, worst tensor {max(errs, key=errs.get)} {max(errs.values()):.2e}")
ok = fp32 <= 1e-5 and lerr <= 1e-2 and allg <= 1e-2
print(f"worst: fp32 {fp32:.2e} (<= 1e-5), bf16 loss {lerr:.2e} / gradients {allg:.2e} (<= 1e-2): {'pass' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF

run "memory at B32 x T512" memory.log "engine buffers.*" -- $PY - <<'EOF'
import sys
import cupy, numpy as np
from nanoeuler import memory
from nanoeuler.config import validate
from nanoeuler.kernels import has_sm90a
from nanoeuler.kernels.bf16.engine import TrainEngine
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.train.config import PretrainConfig

cfg = ModelConfig.named("gpu-270m")
predicted = memory.engine_parts(cfg, 32, 512, "auto", has_sm90a())
eng = TrainEngine(cfg, transformer.init_params(cfg, seed=0), batch=32, seq=512)
got = eng.nbytes()
settings = PretrainConfig.from_section(validate({"pretrain": {"precision": "bf16", "batch_size": 32}})["pretrain"])
card = memory.Budget(12e9, memory.context_for(8), "gpu_memory")
plan = memory.plan_training("pretrain", cfg, settings, card, eval_items=32)
print(f"{cfg.n_params():,} parameters; engine buffers {memory.gb(got)} measured, {memory.gb(sum(predicted.values()))} "
      f"predicted; on a 12 GB card: micro-batch {plan.micro}, predicted peak {memory.gb(plan.predicted)}")
sys.exit(0 if got == sum(predicted.values()) else 1)
EOF

run "step vs torch.compile" bench.log "B32xT512 +ours-bf16.*" -- \
    $PY bench/train_gpu.py --preset gpu-270m --rows 16x512,32x512 --modes torch-compile,ours-bf16 --steps 20 \
        --json "$LOG_DIR/bench.json"

echo
printf '%-32s %s\n' "check" "result"
fail=0
for i in "${!names[@]}"; do
    printf '%-32s %s\n' "${names[$i]}" "${results[$i]}"
    case ${results[$i]} in FAIL*) fail=1 ;; esac
done
exit $fail
