"""Fused AdamW on the GPU: one kernel pass per tensor updates the parameter and both moments.

Same arithmetic, in the same order, as `nanoeuler.optim.AdamW.step` (its NumPy path is the reference):

    >>> opt = AdamW(params)                      # params on the GPU (CuPy float32)      # doctest: +SKIP
    >>> adamw.step(opt, params, grads, lr)       # == opt.step(params, grads, lr)        # doctest: +SKIP

`step` reads the hyper-parameters, moments and step count from the optimizer object and advances its
step count, so checkpoints (`state_tensors`) are unchanged.
"""

from __future__ import annotations

import math

import numpy as np

from nanoeuler.kernels import kernel

_MAX_BLOCKS = 4096


def step_tensor(p, g, m, v, *, beta1, beta2, eps, decay, step_size, inv_sqrt_bc2) -> None:
    """In place on contiguous float32 CuPy arrays of one shape:
    m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p = p * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)."""
    import cupy as cp

    for name, a in (("p", p), ("m", m), ("v", v)):
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError(f"AdamW kernel needs contiguous float32 {name}, got {a.dtype} strides {a.strides}")
    if g.shape != p.shape or m.shape != p.shape or v.shape != p.shape:
        raise ValueError(f"AdamW shapes differ: p {p.shape}, g {g.shape}, m {m.shape}, v {v.shape}")
    g = cp.ascontiguousarray(g, dtype=np.float32)
    n = p.size
    if n == 0:
        return
    blocks = min(_MAX_BLOCKS, (n + 255) // 256)
    kernel("adamw", "adamw_step")(
        (blocks,), (256,),
        (p, g, m, v, np.int64(n), np.float32(beta1), np.float32(beta2), np.float32(decay), np.float32(step_size),
         np.float32(inv_sqrt_bc2), np.float32(eps)))


def step(opt, params: dict, grads: dict, lr: float) -> None:
    """One AdamW step of `opt` (a `nanoeuler.optim.AdamW` whose state is on the GPU), in place."""
    opt.t += 1
    b1, b2 = opt.beta1, opt.beta2
    bc1 = 1.0 - b1 ** opt.t
    bc2 = 1.0 - b2 ** opt.t
    step_size = lr / bc1
    inv_sqrt_bc2 = 1.0 / math.sqrt(bc2)
    for n, p in params.items():
        decay = 1.0 - lr * opt.weight_decay if opt.weight_decay and n not in opt.no_decay else 1.0
        step_tensor(p, grads[n], opt.m[n], opt.v[n], beta1=b1, beta2=b2, eps=opt.eps, decay=decay,
                    step_size=step_size, inv_sqrt_bc2=inv_sqrt_bc2)
