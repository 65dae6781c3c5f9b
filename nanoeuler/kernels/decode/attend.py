"""Launchers of attend.cu: attention of M rows' q (M, H, D) float over their slots' caches kc, vc (slots,
Hkv, L, D), keys 0..pos of each row (meta), into out (M, H, D)."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels.decode.plan import ATTEND_THREADS, KV_WARPS, attend_smem, kv_smem

i32 = np.int32


def _args(q, kc, vc, meta, out, M, H, Hkv, D, L):
    return (q, kc, vc, meta, out, i32(M), i32(H), i32(Hkv), i32(D), i32(L))


def attend(go, q, kc, vc, meta, out, M: int, H: int, Hkv: int, D: int, L: int) -> None:
    """out float32: a block per (row, query head), the GEMV path's operand."""
    go.launch(
        f"attend_{go.suffix}",
        (M, H),
        (ATTEND_THREADS,),
        _args(q, kc, vc, meta, out, M, H, Hkv, D, L),
        shared_mem=attend_smem(L, go.dtype),
    )


def attend_act(go, q, kc, vc, meta, out, M: int, H: int, Hkv: int, D: int, L: int) -> None:
    """out in the weights' storage (the cuBLAS path's operand): a block per (row, query head)."""
    go.launch(
        f"attend_act_{go.suffix}",
        (M, H),
        (ATTEND_THREADS,),
        _args(q, kc, vc, meta, out, M, H, Hkv, D, L),
        shared_mem=attend_smem(L, go.dtype),
    )


def attend_kv_act(go, q, kc, vc, meta, out, M: int, H: int, Hkv: int, D: int, L: int) -> None:
    """attend_act with a block per (row, key/value head): the query heads that share it read its rows once
    (`plan.choose_variants` says where it applies)."""
    go.launch(
        f"attend_kv_act_{go.suffix}",
        (M, Hkv),
        (32 * KV_WARPS,),
        _args(q, kc, vc, meta, out, M, H, Hkv, D, L),
        shared_mem=kv_smem(H, Hkv, D),
    )
