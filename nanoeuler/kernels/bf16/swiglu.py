"""Launchers of swiglu.cu: m = silu(gate) * up from the gate/up GEMM's output, and its backward."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel

i32 = np.int32


def _grid(N: int, F: int) -> tuple:
    """x over groups of 8 columns (2 where F % 8 != 0), y over rows (grid-stride): swiglu.cu's VEC."""
    return (-(-F // (256 * (8 if F % 8 == 0 else 2))), min(N, 4096))


def swiglu_fwd(gu, m) -> None:
    """gu (N, 2F) bf16 = [gate | up] -> m (N, F) bf16 = silu(gate) * up."""
    N, F = m.shape
    kernel("bf16/swiglu", "swiglu_fwd_bf16")(_grid(N, F), (256,), (gu, m, i32(F), i32(N)))


def swiglu_bwd(dm, gu, dgu, m) -> None:
    """dm (N, F), gu (N, 2F) -> dgu (N, 2F) = [dgate | dup], and m again (the forward's, bit for bit)."""
    N, F = m.shape
    kernel("bf16/swiglu", "swiglu_bwd_bf16")(_grid(N, F), (256,), (dm, gu, dgu, m, i32(F), i32(N)))
