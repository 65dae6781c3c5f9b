"""A short timed training run on the GPU: the `gpu` preset (116M) on random tokens, float32.

    python -m nanoeuler.checks.trainbench --preset gpu --batch 16 --steps 12

Each step is what the training loop does: `transformer.loss_and_grads`, global-norm clipping, then the
fused AdamW kernel. Steps are timed with CUDA events; the first `--warmup` steps (kernel compilation,
memory-pool growth) are left out of the median. Prints one table row per step and a summary line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoeuler.checks.trainbench", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu", help="model preset (default gpu, 116M)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--seq", type=int, default=0, help="sequence length (default: the preset's ctx_len)")
    parser.add_argument("--steps", type=int, default=12, help="steps to run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default 2)")
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args(argv)

    import cupy

    from nanoeuler.backend import oom_guard, resolve_device, tf32_enabled
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.optim import AdamW, clip_grad_norm

    resolve_device("gpu")
    cfg = ModelConfig.named(args.preset)
    B, T, K = args.batch, args.seq or cfg.ctx_len, cfg.mtp_heads
    rng = np.random.default_rng(0)
    params = {n: cupy.asarray(p) for n, p in transformer.init_params(cfg, seed=0).items()}
    opt = AdamW(params, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # A fixed batch: the loss must fall step after step, which also shows the update is applied.
    window = rng.integers(0, cfg.vocab_size, size=(B, T + K))
    inputs = cupy.asarray(window[:, :T])
    targets = cupy.asarray(np.stack([window[:, 1 + k : T + 1 + k] for k in range(K)], axis=-1))
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(
        f"trainbench on {name}: preset {args.preset} ({cfg.n_params():,} params), batch {B}x{T}, "
        f"K={K}, float32, TF32 {'on' if tf32_enabled() else 'off'}",
        flush=True,
    )
    pool = cupy.get_default_memory_pool()
    times, losses = [], []
    start_wall = time.perf_counter()
    with oom_guard(B, T):
        for step in range(args.steps):
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            loss, grads = transformer.loss_and_grads(params, inputs, targets, cfg)
            norm = clip_grad_norm(grads, 1.0)
            opt.step(params, grads, args.lr)  # the fused AdamW kernel on CuPy
            del grads
            e1.record()
            e1.synchronize()
            ms = cupy.cuda.get_elapsed_time(e0, e1)
            times.append(ms)
            losses.append(loss)
            print(f"step {step + 1:>3}  loss {loss:.4f}  grad norm {norm:.3f}  {ms:8.1f} ms", flush=True)
    timed = times[args.warmup :] or times
    med = statistics.median(timed)
    print(
        f"trainbench: {len(timed)} timed steps, median {med:.1f} ms/step, {B * T / med * 1e3:,.0f} tokens/s, "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, GPU memory pool {pool.total_bytes() / 2**30:.2f} GiB, "
        f"wall {time.perf_counter() - start_wall:.1f} s"
    )
    ok = all(np.isfinite(losses)) and losses[-1] < losses[0]
    return 0 if ok else 1


if __name__ == "__main__":
    from nanoeuler.errors import UserError

    try:
        sys.exit(main())
    except UserError as exc:
        print(f"trainbench: error: {exc}", file=sys.stderr)
        sys.exit(1)
