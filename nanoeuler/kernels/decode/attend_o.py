"""Launchers of attend_o.cu: the one-row step's x += dx + W_o attention(q over the cache), dx cleared, in one
kernel. q (M, H, D) float, kc/vc (slots, Hkv, L, D), wo (C, H D), x and dx (M, C) float."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels.decode.plan import ATTEND_THREADS, OC_WARPS, OSPLIT, attend_o_splits, attend_smem

i32 = np.int32


def attend_o(go, q, kc, vc, meta, wo, x, dx, M: int, H: int, Hkv: int, D: int, L: int, C: int, n_sm: int) -> None:
    """Every block of a (row, head) attends over all keys, then adds its split of W_o's rows (as many
    splits as fit the GPU's `n_sm` multiprocessors at once)."""
    go.launch(
        f"attend_o_{go.suffix}",
        (M * H, attend_o_splits(M, H, n_sm)),
        (ATTEND_THREADS,),
        (q, kc, vc, meta, wo, x, dx, i32(M), i32(H), i32(Hkv), i32(D), i32(L), i32(C)),
        shared_mem=attend_smem(L, go.dtype) + 4 * D,
    )


def attend_o_cluster(
    go, q, kc, vc, meta, wo, x, dx, M: int, H: int, Hkv: int, D: int, L: int, C: int, alone_keys: int
) -> None:
    """The keys split over a cluster of OSPLIT blocks (compute capability 9.0), which exchange their partial
    softmax; up to `alone_keys` keys each block attends over all of them."""
    go.launch(
        f"attend_o_cluster_{go.suffix}",
        (M * H, OSPLIT),
        (32 * OC_WARPS,),
        (q, kc, vc, meta, wo, x, dx, i32(M), i32(H), i32(Hkv), i32(D), i32(L), i32(C), i32(alone_keys)),
    )
