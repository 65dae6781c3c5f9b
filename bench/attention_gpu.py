"""Causal GQA attention alone on one GPU: our tensor-core kernels (kernels/bf16/flash_*.cu) against PyTorch's
scaled_dot_product_attention backends, same shapes, same process.

    python bench/attention_gpu.py                     # B16xT512 and B16xT1024, H12/4, D64
    python bench/attention_gpu.py --rows 16x1024 --no-torch

Ours, per layer of the `gpu` preset: flash_fwd_ldm (O and logsumexp), flash_bwd_dq_ldm (dq, and
delta = rowsum(dO * O) for the next kernel), flash_bwd_dkdv_ldm (dk, dv); dq, dk and dv are written into
the qkv gradient operand with RoPE undone. On a compute-capability-9.0 GPU also the same three
kernels on warpgroup matrix products, flash_*_wg_d64 (row "ours-wg").

PyTorch: `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` on (B, H, T, D) bf16, forward
and backward (autograd), under each SDPA backend that accepts the shapes (flash, cudnn, efficient).

Each kernel (or torch call) runs 3 times, then 20 timed times between CUDA events; medians. TFLOP/s
counts the causal half: forward 4 * B * H * D * T^2 / 2, backward 2.5x that (five products, not two).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def timed(fn, torch_events=False, reps=20, warmup=3, inner=1) -> float:
    """Median milliseconds of fn() between two CUDA events (CuPy's, or PyTorch's for torch calls).

    With inner > 1, each timed sample queues fn() inner times back to back and counts their mean, so
    the host's launch cost of one call (tens of microseconds for a Python cuBLAS call) stays hidden
    behind the device's work, as it does inside a training step."""
    if torch_events:
        import torch

        def event():
            return torch.cuda.Event(enable_timing=True)

        def elapsed(a, b):
            return a.elapsed_time(b)
    else:
        import cupy

        event, elapsed = cupy.cuda.Event, cupy.cuda.get_elapsed_time
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        e0, e1 = event(), event()
        e0.record()
        for _ in range(inner):
            fn()
        e1.record()
        e1.synchronize()
        ms.append(elapsed(e0, e1) / inner)
    return statistics.median(ms)


def ours(B, T, H, Hkv, D, rng):
    """{kernel: ms} of our attention kernels on random inputs."""
    import cupy

    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16.flash import flash_kernels
    from nanoeuler.model import layers

    fwd, dkdv, dq = (flash_kernels("ldm", D)[k] for k in ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq"))
    N, W = B * T, (H + 2 * Hkv) * D

    def bf16(shape, scale=1.0):  # random bf16 words (the top half of float32 values)
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        return cupy.asarray((x.view(np.uint32) >> 16).astype(np.uint16))

    q, k, v = bf16((B, H, T, D), 1.5), bf16((B, Hkv, T, D), 1.5), bf16((B, Hkv, T, D))
    dout = bf16((N, H * D))
    cos, sin = (cupy.asarray(t) for t in layers.rope_tables(T, D, 10000.0, np, np.float32))
    o = cupy.empty((N, H * D), dtype=np.uint16)
    lse = cupy.empty((B, H, T), dtype=np.float32)
    delta = cupy.empty((B, H, T), dtype=np.float32)
    dqkv = cupy.empty((N, W), dtype=np.uint16)
    i32 = np.int32
    scale = np.float32(1.0 / math.sqrt(D))
    nb = -(-T // 64)
    times = {"fwd": timed(lambda: fwd((B * H, nb), (128,), (q, k, v, o, lse, i32(H), i32(Hkv), i32(T), scale)))}
    rope = (dqkv, cos, sin, i32(H), i32(Hkv), i32(T), scale)
    times["dq"] = timed(lambda: dq((B * H, nb), (128,), (q, k, v, dout, o, lse, delta, *rope)))
    times["dkdv"] = timed(lambda: dkdv((B * Hkv, nb), (128,), (q, k, v, dout, lse, delta, *rope)))
    if D == 64 and has_sm90a():  # the wgmma kernels (sm_90a builds)
        fwd, dkdv, dq = (flash_kernels("wg", D)[k] for k in ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq"))
        times["wg fwd"] = timed(lambda: fwd((B * H, nb), (128,), (q, k, v, o, lse, i32(H), i32(Hkv), i32(T), scale)))
        times["wg dq"] = timed(lambda: dq((B * H, nb), (128,), (q, k, v, dout, o, lse, delta, *rope)))
        times["wg dkdv"] = timed(lambda: dkdv((B * Hkv, nb), (128,), (q, k, v, dout, lse, delta, *rope)))
    cupy.cuda.Stream.null.synchronize()
    return times


def torch_sdpa(B, T, H, Hkv, D):
    """{backend: (fwd ms, bwd ms)} for the SDPA backends that run these shapes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = {}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        try:
            with sdpa_kernel([backend]):

                def fwd():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

                y = fwd()
                f_ms = timed(fwd, torch_events=True)
                b_ms = timed(lambda: torch.autograd.grad(y, (q, k, v), dout, retain_graph=True), torch_events=True)
            out[name] = (f_ms, b_ms)
        except Exception as exc:  # a backend that refuses the shapes is reported, not fatal
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16x512,16x1024", help="comma-separated BxT")
    ap.add_argument("--heads", default="12/4", help="query heads / key-value heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    H, Hkv = (int(x) for x in args.heads.split("/"))
    D = args.head_dim
    lines = []
    for row in args.rows.split(","):
        B, T = (int(x) for x in row.split("x"))
        fwd_flop = 4.0 * B * H * D * T * T / 2
        times = ours(B, T, H, Hkv, D, np.random.default_rng(0))
        bwd = times["dkdv"] + times["dq"]
        lines.append(
            f"B{B}xT{T:<5} ours              {times['fwd']:7.3f} {bwd:7.3f}  "
            f"{fwd_flop / times['fwd'] / 1e9:6.1f} {2.5 * fwd_flop / bwd / 1e9:6.1f}  "
            f"(dq with delta {times['dq']:.3f}, dkdv {times['dkdv']:.3f})"
        )
        print(lines[-1], flush=True)
        if "wg fwd" in times:
            bwd = times["wg dkdv"] + times["wg dq"]
            lines.append(
                f"B{B}xT{T:<5} ours-wg           {times['wg fwd']:7.3f} {bwd:7.3f}  "
                f"{fwd_flop / times['wg fwd'] / 1e9:6.1f} {2.5 * fwd_flop / bwd / 1e9:6.1f}  "
                f"(dq with delta {times['wg dq']:.3f}, dkdv {times['wg dkdv']:.3f})"
            )
            print(lines[-1], flush=True)
        if not args.no_torch:
            for name, res in torch_sdpa(B, T, H, Hkv, D).items():
                if isinstance(res, str):
                    lines.append(f"B{B}xT{T:<5} torch-{name:<11} {res}")
                else:
                    f_ms, b_ms = res
                    lines.append(
                        f"B{B}xT{T:<5} torch-{name:<11} {f_ms:7.3f} {b_ms:7.3f}  "
                        f"{fwd_flop / f_ms / 1e9:6.1f} {2.5 * fwd_flop / b_ms / 1e9:6.1f}"
                    )
                print(lines[-1], flush=True)
    print(f"\nrow        impl               fwd ms  bwd ms  fwd TF  bwd TF  (per layer; H{H}/{Hkv} D{D})")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
