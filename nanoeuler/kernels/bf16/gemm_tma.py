"""Launchers of gemm_tma.cu: GEMMs with an epilogue inside, fed and drained by TMA (sm_90a). Operands
arrive through tensor maps (`nanoeuler.kernels.tma`); each kernel is persistent, a block per multiprocessor."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel
from nanoeuler.kernels.bf16.plan import qkv_rope_gemm_grid, swiglu_gemm_grid

i32 = np.int32
# Two warpgroups in ping-pong and a producer warp; shared memory = 1 KiB of alignment, SG_STAGES stages of
# 32 KiB and their 2 SG_STAGES mbarriers, and the epilogue's 8 KiB boxes of 64 x 64, per warpgroup: in the
# SwiGLU forward gate, up and m of both 64-row halves of its tile (6), in the backward gate and up (4, then
# d(gate) and d(up) over them) and m (2) of two 64 x 64 quarters at a time, with an mbarrier per quarter's
# buffer; in the qkv product with RoPE the two heads of both halves (4).
SWIGLU_GEMM_THREADS = 288
SWIGLU_FWD_GEMM_SMEM = 1024 + 4 * 32768 + 12 * 8192 + 8 * 8
SWIGLU_BWD_GEMM_SMEM = 1024 + 4 * 32768 + 12 * 8192 + 12 * 8
QKV_ROPE_GEMM_SMEM = 1024 + 4 * 32768 + 8 * 8192 + 8 * 8


def prepare_fused_gemm(fn):
    """`fn`, one of the GEMM kernels with an epilogue inside (the fused SwiGLU kernels, `qkv_rope_gemm`),
    allowed the shared memory they need (more than the default 48 KiB)."""
    fn.max_dynamic_shared_size_bytes = max(SWIGLU_FWD_GEMM_SMEM, SWIGLU_BWD_GEMM_SMEM, QKV_ROPE_GEMM_SMEM)
    return fn


def fused_gemm(name: str):
    """The prepared kernel `name` of gemm_tma.cu ("qkv_rope_gemm", "swiglu_fwd_gemm", "swiglu_bwd_gemm")."""
    return prepare_fused_gemm(kernel("bf16/gemm_tma", name))


def run_qkv_rope_gemm(
    fn, x_map, w_map, q_map, k_map, v_map, cos, sin, N: int, C: int, T: int, H: int, Hkv: int, sms: int
) -> None:
    """qkv = xhat Wqkv^T, q and k rotated by RoPE (cos/sin: (T, 32) float32), into q (B, H, T, 64) and k, v
    (B, Hkv, T, 64), T % 64 == 0; xhat (N = B T rows) and Wqkv through `tile_map`s with boxes of 128 rows,
    q/k/v through `heads_map`s (gemm_tma.cu's qkv_rope_gemm)."""
    fn(
        qkv_rope_gemm_grid(N, H + 2 * Hkv, sms),
        (SWIGLU_GEMM_THREADS,),
        (x_map, w_map, q_map, k_map, v_map, cos, sin, i32(N), i32(C), i32(T), i32(H), i32(Hkv)),
        shared_mem=QKV_ROPE_GEMM_SMEM,
    )


def run_swiglu_fwd_gemm(fn, x_map, w_map, gu_map, m_map, N: int, C: int, F: int, sms: int) -> None:
    """gu = xhat Wgu^T and m = silu(gate) * up, from xhat (through `x_map`: `tile_map` with boxes of 128
    rows) and Wgu (through `w_map`: `gate_up_map`), into gu (N, 2F) and m (N, F) (through `gu_map` and
    `m_map`: `tile_map` with boxes of 64 rows) (gemm_tma.cu's swiglu_fwd_gemm)."""
    fn(
        swiglu_gemm_grid(N, F, sms, 64),
        (SWIGLU_GEMM_THREADS,),
        (x_map, w_map, gu_map, m_map, i32(N), i32(C), i32(F)),
        shared_mem=SWIGLU_FWD_GEMM_SMEM,
    )


def run_swiglu_bwd_gemm(
    fn, dy_map, wdt_map, wdt_row0: int, gu_map, dgu_map, m_map, N: int, C: int, F: int, sms: int
) -> None:
    """d(gate|up) and m, from dy (through `dy_map`: `tile_map`, boxes of 128 rows), the rows wdt_row0 ..
    wdt_row0 + F of a `wdt_image` output (through `wdt_map`, the same) and gu; gu, dgu (N, 2F) and m (N, F)
    through `tile_map`s with boxes of 64 rows (gemm_tma.cu's swiglu_bwd_gemm)."""
    fn(
        swiglu_gemm_grid(N, F, sms),
        (SWIGLU_GEMM_THREADS,),
        (dy_map, wdt_map, i32(wdt_row0), gu_map, dgu_map, m_map, i32(N), i32(C), i32(F)),
        shared_mem=SWIGLU_BWD_GEMM_SMEM,
    )


def wdt_image(base, offsets, wdt) -> None:
    """wdt (L, F, C) bf16: each layer's Wd (C, F), at element offsets[i] of the flat bf16 image `base`,
    transposed with its rows permuted (plan.wdt_image_rows): swiglu_bwd_gemm's operand."""
    L, F, C = wdt.shape
    kernel("bf16/gemm_tma", "wdt_image")((-(-F // 32), -(-C // 32), L), (32, 8), (base, offsets, wdt, i32(C), i32(F)))
