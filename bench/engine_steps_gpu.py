"""Step time and memory of the bf16 engine's step variants at the `gpu` preset (116M, T512), on random data:
checkpointing's cost at B16 and B32, accumulation (2 x B16 against 1 x B32), and DPO on the engine against
the fp32 xp path at 16 pairs x 512. Prints one table; run on a GPU machine (scripts/gpu_engine_check.sh)."""

from __future__ import annotations

import argparse
import time

import cupy as cp
import numpy as np

from nanoeuler.config import validate
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.model.dpo import DpoHead
from nanoeuler.train.config import PretrainConfig
from nanoeuler.train.stepper import make_stepper


def settings(**kw):
    return PretrainConfig.from_section({**validate({})["pretrain"], **kw})


def device_used() -> int:
    free, total = cp.cuda.runtime.memGetInfo()
    return total - free


def timed(stepper, make_batch, steps: int, warm: int = 3, head=None, refs=None) -> float:
    """Seconds per step after `warm` steps (the graphs captured), synchronised at both ends."""

    def one():
        batch = make_batch()
        if head is not None:
            for x, _ in batch:
                head.push(refs(x.shape[0]))
        stepper.step(batch, 1e-4)

    for _ in range(warm):
        one()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fp32-steps", type=int, default=3)
    args = ap.parse_args()
    cfg = ModelConfig.named("gpu")
    params = transformer.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    T, V, K = cfg.ctx_len, cfg.vocab_size, cfg.mtp_heads
    pool = cp.get_default_memory_pool()
    rows = []

    def lm_batch(B, split=1):
        def make():
            x = rng.integers(0, V, (B, T))
            y = rng.integers(0, V, (B, T, K))
            return [(a, b) for a, b in zip(np.array_split(x, split), np.array_split(y, split))]

        return make

    def pair_batch(P):
        def make():
            x = rng.integers(0, V, (2 * P, T))
            y = np.full((2 * P, T, K), -1)
            y[:, T // 4 :, 0] = rng.integers(0, V, (2 * P, T - T // 4))  # prompts a quarter, then the response
            return [(x, y)]

        return make

    def measure(name, precision, make, steps, head=None, **kw):
        pool.free_all_blocks()
        base = device_used()
        st = make_stepper(settings(precision=precision, **kw), cfg, params, cp, head_loss=head)
        refs = (lambda n: rng.standard_normal(n) * 5 - 800.0) if head is not None else None
        sec = timed(st, make, steps, head=head, refs=refs, warm=3 if precision == "bf16" else 1)
        engine = getattr(st, "engine", None)
        nb = engine.nbytes() if engine is not None else pool.total_bytes()
        used = device_used() - base
        rows.append((name, sec * 1e3, nb / 2**30, used / 2**30))
        print(
            f"{name:44s} {sec * 1e3:9.1f} ms/step  engine {nb / 2**30:6.2f} GiB  device +{used / 2**30:6.2f} GiB",
            flush=True,
        )
        del st, engine
        pool.free_all_blocks()

    for B in (16, 32):
        measure(f"pretrain B{B}xT{T} bf16", "bf16", lm_batch(B), args.steps, batch_size=B)
        measure(
            f"pretrain B{B}xT{T} bf16 checkpointing",
            "bf16",
            lm_batch(B),
            args.steps,
            batch_size=B,
            checkpoint_activations=True,
        )
    measure(f"pretrain 2 x B16xT{T} bf16 accumulated", "bf16", lm_batch(32, 2), args.steps, batch_size=16, grad_accum=2)
    head = DpoHead(0.1, 0.0)
    measure(f"DPO 16 pairs x {T} bf16 engine", "bf16", pair_batch(16), args.steps, head=head, batch_size=16)
    measure(
        f"DPO 16 pairs x {T} bf16 engine checkpointing",
        "bf16",
        pair_batch(16),
        args.steps,
        head=head,
        batch_size=16,
        checkpoint_activations=True,
    )
    measure(f"DPO 16 pairs x {T} fp32 xp (CuPy)", "fp32", pair_batch(16), args.fp32_steps, head=head, batch_size=16)
    print(f"\n{'step':44s} {'ms/step':>9s} {'engine GiB':>11s} {'device GiB':>11s}")
    for name, ms, nb, used in rows:
        print(f"{name:44s} {ms:9.1f} {nb:11.2f} {used:11.2f}")


if __name__ == "__main__":
    main()
