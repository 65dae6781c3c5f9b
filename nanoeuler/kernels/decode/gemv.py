"""Launchers of gemv.cu: y = W norm(x + x2) over a few rows on float FMAs (a warp an output), the qkv product
with RoPE and the cache write, and head 0 with its argmax. `go` is a `decode.Launch`; x2 and gain may be None
(no second summand, no norm)."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels.decode.plan import GEMV_ROWS, GEMV_WARPS, gemv_smem, gemv_unroll

i32, f32 = np.int32, np.float32
NULL = np.uint64(0)


def opt(a):
    """An optional array argument: the array, or a null pointer."""
    return NULL if a is None else a


def gemv(go, epi: str, w, x, x2, gain, y, M: int, N: int, K: int, eps: float, pdl: bool = True) -> None:
    """y = W norm(x + x2) over M rows of K, N outputs; `epi`: store, store2 (N pairs of rows, two a warp),
    add (y +=), swiglu (y = silu(gate) * up, W: N gate rows then N up rows)."""
    go.launch(
        f"gemv_{epi}_u{gemv_unroll(K, go.dtype)}_{go.suffix}",
        (-(-N // GEMV_WARPS), -(-M // GEMV_ROWS)),
        (32 * GEMV_WARPS,),
        (w, x, opt(x2), opt(gain), y, i32(M), i32(N), i32(K), f32(eps)),
        shared_mem=gemv_smem(M, K),
        pdl=pdl,
    )


def gemv_rope(
    go, w, x, x2, gain, q, kc, vc, meta, cos, sin, M: int, H: int, Hkv: int, D: int, L: int, K: int, eps: float
) -> None:
    """q, k, v of norm(x + x2) over M rows: q (M, H, D) rotated, k rotated and v into the caches kc, vc
    (slots, Hkv, L, D) at each row's slot and position (meta)."""
    pairs = (H + 2 * Hkv) * (D // 2)
    go.launch(
        f"gemv_rope_u{gemv_unroll(K, go.dtype)}_{go.suffix}",
        (-(-pairs // GEMV_WARPS), -(-M // GEMV_ROWS)),
        (32 * GEMV_WARPS,),
        (w, x, opt(x2), gain, q, kc, vc, meta, cos, sin, i32(M), i32(H), i32(Hkv), i32(D), i32(L), i32(K), f32(eps)),
        shared_mem=gemv_smem(M, K),
    )


def head_argmax(
    go, w, x, x2, gain, V: int, K: int, eps: float, best, arrive, out, ctl, hist, cap: int, L: int, chain: bool
) -> None:
    """out[0] = the argmax of head 0's logits (V of them, even) for one row, the logits never stored; with
    `chain`, also the step's record in hist and the next input in ctl (as sampling.argmax_chain)."""
    go.launch(
        f"head_argmax_u{gemv_unroll(K, go.dtype)}_{go.suffix}",
        (-(-V // 2 // GEMV_WARPS),),
        (32 * GEMV_WARPS,),
        (
            w,
            x,
            opt(x2),
            gain,
            i32(V // 2),
            i32(K),
            f32(eps),
            best,
            arrive,
            out,
            ctl,
            hist,
            i32(cap),
            i32(L),
            i32(chain),
        ),
        shared_mem=4 * K,
    )
