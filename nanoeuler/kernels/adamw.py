"""Fused AdamW on the GPU: one kernel pass per tensor updates the parameter and both moments.

Same arithmetic, in the same order, as the xp code of `nanoeuler.optim.AdamW.step`, which is its reference
and which calls `step_tensor` for every tensor when the parameters are CuPy float32:

    >>> opt = AdamW(params)                      # params on the GPU (CuPy float32)      # doctest: +SKIP
    >>> opt.step(params, grads, lr)              # one fused kernel per tensor           # doctest: +SKIP
"""

from __future__ import annotations

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
        (blocks,),
        (256,),
        (
            p,
            g,
            m,
            v,
            np.int64(n),
            np.float32(beta1),
            np.float32(beta2),
            np.float32(decay),
            np.float32(step_size),
            np.float32(inv_sqrt_bc2),
            np.float32(eps),
        ),
    )
