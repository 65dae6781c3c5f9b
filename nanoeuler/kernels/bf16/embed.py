"""Launchers of embed.cu: the token embedding, a warp per row."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel

i32 = np.int32


def embed_fwd(ids, emb, x) -> None:
    """x (N, C) float32 = emb[ids], ids int32 (N,)."""
    N, C = x.shape
    kernel("bf16/embed", "embed_fwd")((-(-N // 8),), (256,), (ids, emb, x, i32(C), i32(N)))


def embed_bwd(dx, ids, demb) -> None:
    """demb[ids[r]] += dx[r] (demb zeroed by the caller: the only gradient the step accumulates into)."""
    N, C = dx.shape
    kernel("bf16/embed", "embed_bwd")((-(-N // 8),), (256,), (dx, ids, demb, i32(C), i32(N)))
