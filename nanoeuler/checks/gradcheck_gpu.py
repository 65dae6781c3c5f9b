"""`nanoeuler gradcheck --device gpu`: the whole model's float32 GPU gradients against float64 CPU ones.

The finite-difference check (`nanoeuler.checks.gradcheck`) proves the CPU backward right in float64;
this check carries that proof to the GPU engine. On the same weights and batch, the loss and every
parameter's gradient are computed twice: by `transformer.loss_and_grads` on NumPy in float64 (the
reference) and on CuPy in float32, where `ops_for(cupy)` swaps in the fused kernels. Per tensor:

    relative error = ||g_gpu - g_cpu|| / ||g_cpu||         pass when <= 1e-5 (TF32 must be off)

Two model shapes run, so both head sizes the kernels are built for are covered, each with a sequence
length that is not a multiple of any tile size, grouped-query attention and ignored targets:
the `small` preset (head size 32) and a 2-layer model of head size 64 like the `gpu` preset's.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from nanoeuler.backend import tf32_enabled, to_numpy
from nanoeuler.errors import UserError
from nanoeuler.model.config import ModelConfig

GPU_THRESHOLD = 1e-5
CPU_DEFAULT_THRESHOLD = 1e-6  # the finite-difference check's default; the float32 check needs its own


def problems():
    """(label, cfg, batch, T) of each model shape checked."""
    small = ModelConfig.named("small")
    d64 = ModelConfig(
        vocab_size=1024, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=256, ffn_hidden=0, mtp_heads=4
    )
    return [("small preset, D32", small, 2, 100), ("2 layers, D64", d64, 2, 200)]


def compare(cfg: ModelConfig, batch: int, T: int, seed: int):
    """-> (loss rel err, [(tensor name, shape, rel err)]) for one random problem."""
    import cupy

    from nanoeuler.checks.problem import random_problem
    from nanoeuler.model import transformer

    params, inputs, targets = random_problem(cfg, seed, batch=batch, T=T)
    ref_params = {n: np.asarray(p, dtype=np.float32).astype(np.float64) for n, p in params.items()}
    loss_ref, g_ref = transformer.loss_and_grads(ref_params, inputs, targets, cfg)
    dev = {n: cupy.asarray(p, dtype=np.float32) for n, p in params.items()}
    loss_gpu, g_gpu = transformer.loss_and_grads(dev, cupy.asarray(inputs), cupy.asarray(targets), cfg)
    rows = []
    for name in params:
        a = np.asarray(to_numpy(g_gpu[name]), dtype=np.float64)
        r = g_ref[name]
        err = float(np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30)) if np.isfinite(a).all() else float("nan")
        rows.append((name, params[name].shape, err))
    return abs(loss_gpu - loss_ref) / abs(loss_ref), rows


def _worst(errs) -> float:
    """The largest error; NaN when any is NaN (a NaN gradient never passes)."""
    return float("nan") if not np.isfinite(errs).all() else float(max(errs))


def run(args) -> int:
    """The `--device gpu` branch of `nanoeuler gradcheck` (args: seed, threshold)."""
    if tf32_enabled():
        raise UserError(
            "CUPY_TF32 is set: cuBLAS would use TF32 (~1e-3) and the float32 check (1e-5) "
            "means nothing; unset CUPY_TF32"
        )
    import cupy

    threshold = getattr(args, "threshold", None)
    if threshold is None or threshold == CPU_DEFAULT_THRESHOLD:
        threshold = GPU_THRESHOLD
    seed = int(getattr(args, "seed", 0) or 0)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(
        f"gradcheck on {name}: float32 GPU kernels vs float64 CPU gradients, same weights and batch; "
        f"relative error ||gpu - cpu|| / ||cpu|| per tensor, threshold {threshold:.0e}"
    )
    every = []
    for label, cfg, batch, T in problems():
        start = time.perf_counter()
        loss_err, rows = compare(cfg, batch, T, seed)
        width = max(len(n) for n, _, _ in rows)
        print(
            f"\n{label}: {cfg.n_params():,} parameters, batch {batch}x{T}, heads {cfg.n_heads}/{cfg.n_kv_heads}, "
            f"K={cfg.mtp_heads} ({time.perf_counter() - start:.1f} s)"
        )
        print(f"{'tensor':<{width}}  {'shape':<12}  {'rel err':>9}  pass")
        print(f"{'(loss)':<{width}}  {'':<12}  {loss_err:>9.2e}  {'ok' if loss_err <= threshold else 'FAIL'}")
        for n, shape, err in rows:
            ok = np.isfinite(err) and err <= threshold
            print(f"{n:<{width}}  {str(tuple(shape)):<12}  {err:>9.2e}  {'ok' if ok else 'FAIL'}")
        errs = [loss_err] + [e for _, _, e in rows]
        every += errs
        print(f"{label}: max relative error {_worst(errs):.3e}")
    worst = _worst(every)
    passed = bool(np.isfinite(worst)) and worst <= threshold
    print(f"\nmax relative error: {worst:.3e} (threshold {threshold:.0e}): {'pass' if passed else 'FAIL'}")
    sys.stdout.flush()
    return 0 if passed else 1
