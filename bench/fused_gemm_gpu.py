"""The GEMMs with an epilogue inside (SwiGLU, RoPE) at the step's shapes, against cuBLAS plus the separate kernel.

    python bench/fused_gemm_gpu.py                 # N = 32768 rows (B64xT512, T 512), C 768, F 2048, H 12/4
    python bench/fused_gemm_gpu.py --rows 8192     # B16xT512

Forward, unfused (the engine without `fuse_swiglu`): cuBLAS writes gu = x Wgu^T as bf16, then
`swiglu_fwd_bf16` reads it and writes m; fused (`swiglu_fwd_gemm`, sm_90a): one kernel writes gu and m.
Backward, unfused: cuBLAS writes dm = dy Wd as bf16, then `swiglu_bwd_bf16` reads dm and gate/up and
writes d(gate|up) and m; fused (`swiglu_bwd_gemm`): one kernel, dm kept in registers.
qkv, unfused: cuBLAS writes qkv = x Wqkv^T as bf16, then `qkv_rope_split_bf16` reads it and writes q, k
(rotated) and v in the attention layouts; fused (`qkv_rope_gemm`): one kernel writes q, k, v.
Random bf16 operands; 3 warm-up calls, then the median of 30 calls between CUDA events. The last lines
compare the fused outputs with the unfused ones: gu must be identical to the bf16 rounding of the same
float32 sums, up to cuBLAS's summation order; d(gate|up) differ by bf16 rounding (the fused dm is
rounded once, after float32 accumulation, as cuBLAS's is); m must equal the unfused m of the same gu;
q/k/v are compared with the unfused ones (identical where the two products round alike).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import cupy as cp

    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16 import bf16_kernel as kernel
    from nanoeuler.kernels.bf16.gemm_tma import (
        prepare_fused_gemm,
        run_qkv_rope_gemm,
        run_swiglu_bwd_gemm,
        run_swiglu_fwd_gemm,
    )
    from nanoeuler.kernels.bf16.plan import wdt_image_rows
    from nanoeuler.kernels.cublas import Gemm, Matrix
    from nanoeuler.kernels.tma import gate_up_map, heads_map, tile_map
    from nanoeuler.model import layers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    N, C, F = args.rows, args.dim, args.hidden
    T, H, Hkv = args.seq, args.heads, args.kv_heads
    if N % T:
        ap.error(f"--rows {N} is not a multiple of --seq {T}")
    B, W = N // T, (H + 2 * Hkv) * 64
    rng = np.random.default_rng(0)

    def bf16(a):
        return (cp.asarray(a, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    def f32(w):
        return (w.astype(cp.uint32) << 16).view(cp.float32)

    def timed(fn):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(args.reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b))
        return statistics.median(ts)

    x = bf16(rng.standard_normal((N, C)))
    wgu = bf16(rng.standard_normal((2 * F, C)) * 0.05)
    dy = bf16(rng.standard_normal((N, C)) * 0.5)
    wd = bf16(rng.standard_normal((C, F)) * 0.05)
    gu = bf16(rng.standard_normal((N, 2 * F)))
    gu_f, m_f = cp.empty((N, 2 * F), cp.uint16), cp.empty((N, F), cp.uint16)
    dm = cp.empty((N, F), cp.uint16)
    dgu, m = cp.empty((N, 2 * F), cp.uint16), cp.empty((N, F), cp.uint16)
    gemm = Gemm(cp.cuda.get_current_stream())
    glu_fwd, glu_bwd = kernel("swiglu_fwd_bf16"), kernel("swiglu_bwd_bf16")
    vec = 8 if F % 8 == 0 else 2
    glu_grid = (-(-F // (256 * vec)), min(N, 4096))

    def fwd_gemm():
        gemm(Matrix(gu_f), Matrix(x), Matrix(wgu), tb=True)

    def fwd_glu():
        glu_fwd(glu_grid, (256,), (gu_f, m_f, np.int32(F), np.int32(N)))

    def bwd_gemm():
        gemm(Matrix(dm), Matrix(dy), Matrix(wd))

    def bwd_glu():
        glu_bwd(glu_grid, (256,), (dm, gu, dgu, m, np.int32(F), np.int32(N)))

    wqkv = bf16(rng.standard_normal((W, C)) * 0.05)
    qkv = cp.empty((N, W), cp.uint16)
    q, k, v = (cp.empty((B, n, T, 64), cp.uint16) for n in (H, Hkv, Hkv))
    cos, sin = (cp.asarray(a) for a in layers.rope_tables(T, 64, 10000.0, np, np.float32))
    split = kernel("qkv_rope_split_bf16")

    def qkv_gemm():
        gemm(Matrix(qkv), Matrix(x), Matrix(wqkv), tb=True)

    def qkv_split():
        split(
            (-(-(N * (H + 2 * Hkv) * 4) // 256),),
            (256,),
            (qkv, cos, sin, q, k, v, np.int32(T), np.int32(H), np.int32(Hkv), np.int32(64), np.int32(N)),
        )

    qkv_products = W / F  # in N x C x F products
    rows = [
        ("qkv: cuBLAS qkv", qkv_products, timed(qkv_gemm)),
        ("qkv: qkv_rope_split_bf16", 0, timed(qkv_split)),
        ("qkv: unfused (both)", qkv_products, timed(lambda: (qkv_gemm(), qkv_split()))),
        ("fwd: cuBLAS gu", 2, timed(fwd_gemm)),
        ("fwd: swiglu_fwd_bf16", 0, timed(fwd_glu)),
        ("fwd: unfused (both)", 2, timed(lambda: (fwd_gemm(), fwd_glu()))),
        ("bwd: cuBLAS dm", 1, timed(bwd_gemm)),
        ("bwd: swiglu_bwd_bf16", 0, timed(bwd_glu)),
        ("bwd: unfused (both)", 1, timed(lambda: (bwd_gemm(), bwd_glu()))),
    ]
    gu_ref, dgu_ref, m_ref = gu_f.copy(), dgu.copy(), m.copy()
    qkv_ref = [a.copy() for a in (q, k, v)]
    compare = []
    if has_sm90a():
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        rope = prepare_fused_gemm(kernel("qkv_rope_gemm"))
        rope_maps = (tile_map(x, 128), tile_map(wqkv, 128), heads_map(q), heads_map(k), heads_map(v))
        for a in (q, k, v):
            a.fill(0xFFFF)
        rows.insert(
            3,
            (
                "qkv: qkv_rope_gemm (fused)",
                qkv_products,
                timed(lambda: run_qkv_rope_gemm(rope, *rope_maps, cos, sin, N, C, T, H, Hkv, sms)),
            ),
        )
        errs = [float(cp.linalg.norm(f32(a) - f32(r)) / cp.linalg.norm(f32(r))) for a, r in zip((q, k, v), qkv_ref)]
        same = all(bool((a == r).all()) for a, r in zip((q, k, v), qkv_ref))
        compare.append(f"qkv fused vs unfused: q/k/v rel. diff {max(errs):.1e}, identical: {same}")
        fwd = prepare_fused_gemm(kernel("swiglu_fwd_gemm"))
        fwd_maps = (tile_map(x, 128), gate_up_map(wgu), tile_map(gu_f, 64), tile_map(m_f, 64))
        gu_f.fill(0)
        m_f.fill(0)
        rows.append(
            ("fwd: swiglu_fwd_gemm (fused)", 2, timed(lambda: run_swiglu_fwd_gemm(fwd, *fwd_maps, N, C, F, sms)))
        )
        err = float(cp.linalg.norm(f32(gu_f) - f32(gu_ref)) / cp.linalg.norm(f32(gu_ref)))
        fwd_glu_of_fused = m_f.copy()
        fwd_glu()  # the unfused m of the fused kernel's gu
        compare.append(
            f"fwd fused vs unfused: gu rel. diff {err:.1e}, m identical to swiglu_fwd_bf16 of its gu: "
            f"{bool((fwd_glu_of_fused == m_f).all())}"
        )
        wdt = cp.empty((F, C), cp.uint16)
        wdt[cp.asarray(wdt_image_rows(F))] = wd.T  # as wdt_image lays Wd out
        bwd = prepare_fused_gemm(kernel("swiglu_bwd_gemm"))
        bwd_maps = (tile_map(dy, 128), tile_map(wdt, 128), 0, tile_map(gu, 64), tile_map(dgu, 64), tile_map(m, 64))
        dgu.fill(0)
        m.fill(0)
        rows.append(
            ("bwd: swiglu_bwd_gemm (fused)", 1, timed(lambda: run_swiglu_bwd_gemm(bwd, *bwd_maps, N, C, F, sms)))
        )
        err = float(cp.linalg.norm(f32(dgu) - f32(dgu_ref)) / cp.linalg.norm(f32(dgu_ref)))
        compare.append(f"bwd fused vs unfused: d(gate|up) rel. diff {err:.1e}, m identical: {bool((m == m_ref).all())}")
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"{name}: N {N}, C {C}, F {F}, T {T}, H {H}/{Hkv}; median of {args.reps} calls")
    print(f"{'kernel':<30} {'ms':>7} {'TFLOP/s':>8}")
    for label, products, ms in rows:  # products: how many N x C x F products (gate/up is two, qkv W / F)
        tflops = f"{products * 2 * N * C * F / ms / 1e9:8.1f}" if products else f"{'-':>8}"
        print(f"{label:<30} {ms:7.3f} {tflops}")
    for line in compare:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
