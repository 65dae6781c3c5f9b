"""The MLP backward's dm = dy Wd and SwiGLU backward at the step's shapes, fused or not.

    python bench/swiglu_gemm_gpu.py                 # N = 32768 rows (B64xT512), C 768, F 2048
    python bench/swiglu_gemm_gpu.py --rows 8192     # B16xT512

Unfused (the engine without `fuse_swiglu`): cuBLAS writes dm as bf16, then `swiglu_bwd_bf16` reads dm and
gate/up and writes d(gate|up) and m. Fused (`swiglu_bwd_gemm`, sm_90a): one kernel, dm kept in registers.
Random bf16 operands; 3 warm-up calls, then the median of 30 calls between CUDA events. The last
columns compare the fused outputs with the unfused ones: d(gate|up) differ by bf16 rounding (the fused
dm is rounded once, after float32 accumulation, as cuBLAS's is), m must be identical.
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

    from nanoeuler.kernels import has_sm90a, kernel
    from nanoeuler.kernels.cublas import Gemm, Matrix
    from nanoeuler.kernels.engine import prepare_swiglu_bwd_gemm, run_swiglu_bwd_gemm, wdt_image_rows
    from nanoeuler.kernels.tma import tile_map

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    N, C, F = args.rows, args.dim, args.hidden
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

    dy = bf16(rng.standard_normal((N, C)) * 0.5)
    wd = bf16(rng.standard_normal((C, F)) * 0.05)
    gu = bf16(rng.standard_normal((N, 2 * F)))
    dm = cp.empty((N, F), cp.uint16)
    dgu, m = cp.empty((N, 2 * F), cp.uint16), cp.empty((N, F), cp.uint16)
    gemm = Gemm(cp.cuda.get_current_stream())
    glu = kernel("bf16", "swiglu_bwd_bf16")
    vec = 8 if F % 8 == 0 else 2
    glu_grid = (-(-F // (256 * vec)), min(N, 4096))

    def unfused():
        gemm(Matrix(dm), Matrix(dy), Matrix(wd))
        glu(glu_grid, (256,), (dm, gu, dgu, m, np.int32(F), np.int32(N)))

    flop = 2 * N * C * F
    rows = [("cuBLAS dm", timed(lambda: gemm(Matrix(dm), Matrix(dy), Matrix(wd)))),
            ("swiglu_bwd_bf16", timed(lambda: glu(glu_grid, (256,), (dm, gu, dgu, m, np.int32(F), np.int32(N))))),
            ("unfused (both)", timed(unfused))]
    dgu_ref, m_ref = dgu.copy(), m.copy()
    compare = ""
    if has_sm90a():
        wdt = cp.empty((F, C), cp.uint16)
        wdt[cp.asarray(wdt_image_rows(F))] = wd.T  # as wdt_image lays Wd out
        fn = prepare_swiglu_bwd_gemm(kernel("bf16", "swiglu_bwd_gemm"))
        maps = (tile_map(dy, 128), tile_map(wdt, 128))
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        dgu.fill(0)
        m.fill(0)
        rows.append(("swiglu_bwd_gemm (fused)",
                     timed(lambda: run_swiglu_bwd_gemm(fn, *maps, 0, gu, dgu, m, N, C, F, sms))))
        err = float(cp.linalg.norm(f32(dgu) - f32(dgu_ref)) / cp.linalg.norm(f32(dgu_ref)))
        compare = f"d(gate|up) rel. diff {err:.1e}, m identical: {bool((m == m_ref).all())}"
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"{name}: N {N}, C {C}, F {F}; median of {args.reps} calls")
    print(f"{'kernel':<26} {'ms':>7} {'TFLOP/s':>8}")
    for label, ms in rows:
        print(f"{label:<26} {ms:7.3f} {flop / ms / 1e9 if label != 'swiglu_bwd_bf16' else float('nan'):8.1f}")
    if compare:
        print(f"fused vs unfused: {compare}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
