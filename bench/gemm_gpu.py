"""The matrix products of one bf16 training step, one by one: where the GEMM time goes.

    python bench/gemm_gpu.py                      # the `gpu` preset at B16xT1024
    python bench/gemm_gpu.py --rows 16x512,64x512 --no-torch

Each product of `nanoeuler.kernels.bf16.engine.TrainEngine.forward_backward` runs at its own shape and operand
layout through the engine's cuBLAS wrapper (`cublas.Gemm`: bf16 operands, float32 accumulation, the output
bf16 or float32 as in the step, beta = 1 where the step accumulates), 3 times, then 20 timed samples
of 10 back-to-back calls between CUDA events; medians. `count` is how often the step runs it, so
`step ms` = ms x count, and the column sums to the step's GEMM time (compare with
`bench/train_gpu.py --profile`).

Peer: PyTorch's product of bf16 tensors with the same M, N, K and output type (`torch.mm`, with
`out_dtype=float32` for float32 outputs, `torch.addmm` where beta = 1; PyTorch reaches cuBLAS through
cublasLt), timed the same way. A product well below the peer's rate points at a layout or call that
cuBLAS handles badly; one writing float32 pays for the wider output (and, with beta = 1, for reading
it back) on either side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention_gpu import timed  # noqa: E402


def step_gemms(cfg, B, T, rows_per_chunk):
    """(name, count, (M, N, K), a_shape, ta, b_shape, tb, out dtype, beta) for every product of a step.

    Shapes are the engine's row-major operands: c (M, N) = op(a) @ op(b)."""
    L, C, H, Hkv, D, F, V, K = cfg.letters
    N, QKV, HD, R = B * T, (H + 2 * Hkv) * D, H * D, rows_per_chunk
    chunks = -(-N // R)
    f32, bf = "f32", "bf16"
    return [
        # forward, per layer
        ("fwd qkv = h1 Wqkv^T", L, (N, QKV, C), (N, C), False, (QKV, C), True, bf, 0),
        ("fwd ob = a Wo^T", L, (N, C, HD), (N, HD), False, (C, HD), True, bf, 0),
        ("fwd gu = h2 Wgu^T", L, (N, 2 * F, C), (N, C), False, (2 * F, C), True, bf, 0),
        ("fwd ybr = m Wd^T", L, (N, C, F), (N, F), False, (C, F), True, bf, 0),
        # output heads, per head and chunk of rows
        ("heads logits = xn Wk^T", K * chunks, (R, V, C), (R, C), False, (V, C), True, bf, 0),
        ("heads dxn += dlg Wk", K * chunks, (R, C, V), (R, V), False, (V, C), False, f32, 1),
        ("heads dWk += dlg^T xn", K * chunks, (V, C, R), (R, V), True, (R, C), False, f32, int(chunks > 1)),
        # backward, per layer
        ("bwd dm = dx Wd", L, (N, F, C), (N, C), False, (C, F), False, bf, 0),
        ("bwd dWd = dx^T m", L, (C, F, N), (N, C), True, (N, F), False, f32, 0),
        ("bwd dWgu = dgu^T h2", L, (2 * F, C, N), (N, 2 * F), True, (N, C), False, f32, 0),
        ("bwd dh = dgu Wgu", L, (N, C, 2 * F), (N, 2 * F), False, (2 * F, C), False, bf, 0),
        ("bwd dWo = dx^T a", L, (C, HD, N), (N, C), True, (N, HD), False, f32, 0),
        ("bwd da = dx Wo", L, (N, HD, C), (N, C), False, (C, HD), False, bf, 0),
        ("bwd dWqkv = dqkv^T h1", L, (QKV, C, N), (N, QKV), True, (N, C), False, f32, 0),
        ("bwd dh = dqkv Wqkv", L, (N, C, QKV), (N, QKV), False, (QKV, C), False, bf, 0),
    ]


def ours_ms(spec, rng):
    import cupy

    from nanoeuler.kernels.cublas import BF16_STORAGE, Gemm, Matrix

    _, _, (M, N, _K), a_shape, ta, b_shape, tb, out, beta = spec

    def bf16(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return cupy.asarray((x.view(np.uint32) >> 16).astype(BF16_STORAGE))

    a, b = Matrix(bf16(a_shape)), Matrix(bf16(b_shape))
    c = Matrix(cupy.zeros((M, N), dtype=np.float32 if out == "f32" else BF16_STORAGE))
    gemm = Gemm()
    return timed(lambda: gemm(c, a, b, ta=ta, tb=tb, beta=float(beta)), inner=10)


def torch_ms(spec):
    """PyTorch's time for the same product and output type: `torch.mm` (bf16 out), or for float32 outputs
    `torch.mm(..., out_dtype=float32)` / `torch.addmm(c, ..., out_dtype=float32)` (beta = 1)."""
    import torch

    _, _, (M, N, K), *_rest = spec
    out, beta = _rest[-2], _rest[-1]
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    if out == "bf16":
        return timed(lambda: torch.mm(a, b), torch_events=True, inner=10)
    c = torch.zeros(M, N, device="cuda", dtype=torch.float32)
    if beta:
        return timed(lambda: torch.addmm(c, a, b, out_dtype=torch.float32), torch_events=True, inner=10)
    return timed(lambda: torch.mm(a, b, out_dtype=torch.float32), torch_events=True, inner=10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpu")
    ap.add_argument("--rows", default="16x1024", help="comma-separated BxT")
    ap.add_argument("--chunk-rows", type=int, default=0, help="output-head rows per chunk (default: the engine's)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)

    from nanoeuler.kernels.bf16.plan import carve, head_chunk_rows, mlp_scratch
    from nanoeuler.model.config import ModelConfig

    cfg = ModelConfig.named(args.preset)
    rng = np.random.default_rng(0)
    for row in args.rows.split(","):
        B, T = (int(x) for x in row.split("x"))
        # the engine's chunk: as many rows as the MLP scratch holds
        R = args.chunk_rows or head_chunk_rows(B * T, cfg.vocab_size, carve(mlp_scratch(B * T, cfg.hidden))[1])
        print(f"\nB{B}xT{T}, output-head chunk {R} rows")
        print(
            f"{'product':<24} {'M':>6} {'N':>6} {'K':>6} {'out':>4} {'count':>5} {'ms':>7} {'TFLOP/s':>8} "
            f"{'step ms':>8} {'torch ms':>8} {'x torch':>7}"
        )
        tot = tot_torch = 0.0
        for spec in step_gemms(cfg, B, T, min(R, B * T)):
            name, count, (M, N, K), *_rest = spec
            out, beta = _rest[-2], _rest[-1]
            ms = ours_ms(spec, rng)
            tms = float("nan") if args.no_torch else torch_ms(spec)
            tot += ms * count
            tot_torch += tms * count
            print(
                f"{name:<24} {M:>6} {N:>6} {K:>6} {out + ('+' if beta else ''):>5} {count:>5} {ms:>7.3f} "
                f"{2.0 * M * N * K / ms / 1e9:>8.1f} {ms * count:>8.2f} {tms:>8.3f} {tms / ms:>7.2f}",
                flush=True,
            )
        print(
            f"{'step total':<24} {'':>6} {'':>6} {'':>6} {'':>5} {'':>5} {'':>7} {'':>8} {tot:>8.2f} {tot_torch:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
