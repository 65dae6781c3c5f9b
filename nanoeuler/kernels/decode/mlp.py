"""Launcher of mlp.cu: the one-row step's MLP, dx += W_down (silu(W_gate norm(x)) * W_up norm(x)), in one
kernel (wgu: F gate rows then F up rows of C; wd (C, F))."""

from __future__ import annotations


import numpy as np

from nanoeuler.kernels.decode.plan import MLP_FC, gemv_unroll, mlp_smem

i32, f32 = np.int32, np.float32


def swiglu_down(go, wgu, wd, x, gain, dx, F: int, C: int, eps: float) -> None:
    """One row: a block per MLP_FC hidden units, meeting in dx by atomicAdd (dx starts at zero). Past a
    width of about 1,800 (bf16; 1,200 fp32) a block needs more than the default 48 KB of shared memory,
    which `Launch.launch` allows its kernel first (`plan.smem_opt_in`)."""
    u, smem = gemv_unroll(C, go.dtype), mlp_smem(C, go.dtype)
    go.launch(
        f"swiglu_down_u{u}_r1_{go.suffix}",
        (-(-F // MLP_FC), 1),
        (32 * MLP_FC,),
        (wgu, wd, x, gain, dx, i32(1), i32(F), i32(C), f32(eps)),
        shared_mem=smem,
    )
