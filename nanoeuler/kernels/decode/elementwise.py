"""Launchers of elementwise.cu: the embedding, and the cuBLAS path's kernels between its GEMMs. A block a
row (the SwiGLU: a row's values over several); `meta` holds the rows' ids, slots and positions."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels.decode.gemv import opt

i32, f32 = np.int32, np.float32


def embed(go, meta, emb, x, dx, M: int, C: int) -> None:
    """x[m] = emb[id of row m] (float32), dx[m] = 0."""
    go.launch(f"embed_{go.suffix}", (M,), (256,), (meta, emb, x, dx, i32(M), i32(C)))


def rmsnorm_act(go, x, gain, a, M: int, C: int, eps: float) -> None:
    """a[m] = x[m] / rms(x[m]) * gain, in the weights' storage (the next GEMM's operand)."""
    go.launch(f"rmsnorm_act_{go.suffix}", (M,), (256,), (x, gain, a, i32(C), f32(eps)))


def rope_cache(go, qkv, meta, q, kc, vc, cos, sin, qh, kh, vh, M: int, H: int, Hkv: int, D: int, L: int) -> None:
    """qkv (M, (H + 2 Hkv) D) float: q rotated into q (M, H, D), k rotated and v into the caches; with qh
    given (a prefill from position 0), q, k, v also into qh (H, M, D), kh, vh (Hkv, M, D), and q not."""
    go.launch(
        f"rope_cache_{go.suffix}",
        (M,),
        (256,),
        (qkv, meta, q, kc, vc, cos, sin, opt(qh), opt(kh), opt(vh), i32(M), i32(H), i32(Hkv), i32(D), i32(L)),
    )


def swiglu_act(go, gu, out, M: int, F: int) -> None:
    """out = silu(gu[:, :F]) * gu[:, F:], in the weights' storage."""
    go.launch(f"swiglu_act_{go.suffix}", (M, -(-F // 256)), (256,), (gu, out, i32(F)))
