"""`nanoeuler gradcheck`: every analytic gradient against finite differences, in float64.

A small random model (`problem.random_problem`: K = 3 heads, 2 query heads per key/value head, T = 6
so RoPE and the causal mask matter, some targets -1) with weights of order one, so a wrong term in any
backward shows up. For each tensor, `--samples` entries (always the one with the largest analytic
gradient) are perturbed and the loss differentiated by the fourth-order central difference

    g ~ (8 (L(w + h) - L(w - h)) - (L(w + 2h) - L(w - 2h))) / (12 h),   h = 3e-3,

whose truncation (~h^4) and rounding (~1e-16 |L| / h) errors are both near 1e-13, so entries around
1e-6 are checked to better than 1e-6 relative. Per entry the relative error is |a - n| / max(|a| + |n|,
1e-12); a line per tensor gives its largest, the last the overall largest, and the exit status is 1
above `--threshold`. The analytic side runs on any backend (`--device gpu`: `gradcheck_gpu`, float32
kernels against float64 CPU gradients); the numerical side is NumPy.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from nanoeuler.backend import add_device_argument, get_xp, resolve_device, to_numpy
from nanoeuler.checks.problem import CHECK_CONFIG, random_problem
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig

STEP = 3e-3
DENOM_FLOOR = 1e-12


def analytic_grads(params, batch, cfg: ModelConfig, xp=np):
    """(loss, grads as NumPy float64) computed on backend `xp` in float64."""
    inputs, targets = batch
    dev = {name: xp.asarray(p, dtype=xp.float64) for name, p in params.items()}
    loss, grads = transformer.loss_and_grads(dev, xp.asarray(inputs), xp.asarray(targets), cfg)
    return float(loss), {name: np.asarray(to_numpy(g), dtype=np.float64) for name, g in grads.items()}


def numeric_grad(params, batch, cfg, name, index, h=STEP):
    """The fourth-order central difference of the loss with respect to params[name][index] (NumPy float64)."""
    inputs, targets = batch
    w = params[name]
    orig = w[index]

    def loss_at(value):
        w[index] = value
        return transformer.forward_loss(params, inputs, targets, cfg)[0]

    try:
        lp1, lm1 = loss_at(orig + h), loss_at(orig - h)
        lp2, lm2 = loss_at(orig + 2 * h), loss_at(orig - 2 * h)
    finally:
        w[index] = orig
    # differences first: equal losses give exactly 0, and less rounding than summing the four terms
    return (8.0 * (lp1 - lm1) - (lp2 - lm2)) / (12.0 * h)


def relative_error(a, n) -> float:
    return abs(a - n) / max(abs(a) + abs(n), DENOM_FLOOR)


def check(cfg: ModelConfig = CHECK_CONFIG, seed: int = 0, samples: int = 48, xp=np, out=sys.stdout):
    """Print one line per tensor; return {name: max relative error}."""
    params, inputs, targets = random_problem(cfg, seed)
    batch = (inputs, targets)
    loss, grads = analytic_grads(params, batch, cfg, xp)
    rng = np.random.default_rng(seed + 1)
    errors = {}
    width = max(len(n) for n in params)
    print(
        f"gradcheck: {cfg.n_params()} parameters in {len(params)} tensors, batch {inputs.shape}, "
        f"K={cfg.mtp_heads}, heads {cfg.n_heads}/{cfg.n_kv_heads}, "
        f"{int((targets < 0).sum())} of {targets.size} targets ignored, loss {loss:.6f}",
        file=out,
    )
    for name, p in params.items():
        g = grads[name]
        flat = g.reshape(-1)
        if p.size <= samples:
            picks = np.arange(p.size)
        else:
            picks = rng.choice(p.size, size=samples - 1, replace=False)
            picks = np.unique(np.append(picks, np.argmax(np.abs(flat))))
        worst = 0.0
        for j in picks:
            index = np.unravel_index(j, p.shape)
            n = numeric_grad(params, batch, cfg, name, index)
            worst = max(worst, relative_error(flat[j], n))
        errors[name] = worst
        print(
            f"{name:<{width}}  {str(p.shape):<10} checked {len(picks):>4}/{p.size:<5} "
            f"max|grad| {np.abs(flat).max():.2e}  max rel err {worst:.2e}",
            file=out,
        )
    return errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and batch (default 0)")
    parser.add_argument(
        "--samples",
        type=int,
        default=48,
        help="entries checked per tensor; smaller tensors are checked whole (default 48)",
    )
    parser.add_argument(
        "--threshold", type=float, default=1e-6, help="largest relative error that passes (default 1e-6)"
    )


def run(args: argparse.Namespace) -> int:
    device = args.device or sections(args, "device")["device"]
    xp = get_xp(resolve_device(device))
    if xp is not np:  # the GPU engine's check: float32 kernels vs these float64 gradients
        from nanoeuler.checks import gradcheck_gpu

        return gradcheck_gpu.run(args)
    start = time.perf_counter()
    errors = check(seed=args.seed, samples=args.samples, xp=xp)
    worst = max(errors.values())
    print(
        f"analytic gradients on {'gpu' if xp is not np else 'cpu'}, "
        f"{time.perf_counter() - start:.1f} s; threshold {args.threshold:.0e}: "
        f"{'pass' if worst <= args.threshold else 'FAIL'}"
    )
    print(f"max relative error: {worst:.3e}")
    return 0 if worst <= args.threshold else 1
