"""Launchers of tgemv.cu: the products of gemv.py for 2 to 16 rows of bf16 weights on the tensor cores.
`ch` is the chunks of 32 columns a warp (`plan.tc_chunks`; 4 only for swiglu and rope)."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels.decode.gemv import opt
from nanoeuler.kernels.decode.plan import TC_WARPS

i32, f32 = np.int32, np.float32


def tgemv(go, epi: str, ch: int, w, x, x2, gain, y, M: int, N: int, K: int, eps: float, pdl: bool = True) -> None:
    """y = W norm(x + x2) over M rows; `epi`: store, add, swiglu (as gemv.gemv; a block owns 8 outputs)."""
    go.launch(
        f"tgemv_{epi}_c{ch}",
        (-(-N // 8),),
        (32 * TC_WARPS,),
        (w, x, opt(x2), opt(gain), y, i32(M), i32(N), i32(K), f32(eps)),
        pdl=pdl,
    )


def tgemv_rope(
    go, ch: int, w, x, x2, gain, q, kc, vc, meta, cos, sin, M: int, H: int, Hkv: int, D: int, L: int, K: int, eps: float
) -> None:
    """gemv.gemv_rope for 2 to 16 rows (D % 16 == 0: a block's 8 pairs lie in one head)."""
    pairs = (H + 2 * Hkv) * (D // 2)
    go.launch(
        f"tgemv_rope_c{ch}",
        (-(-pairs // 8),),
        (32 * TC_WARPS,),
        (w, x, opt(x2), gain, q, kc, vc, meta, cos, sin, i32(M), i32(H), i32(Hkv), i32(D), i32(L), i32(K), f32(eps)),
    )
