"""Launchers of optim.cu: the gradient norm's sum of squares, AdamW with clipping read from the device,
the bf16 GEMM image of the master weights (norm gains folded in), and Muon's kernels.

The sums of squares (the gradient norm, each Muon matrix's norm) add their blocks' partial sums in a
fixed order, so that equal gradients give equal norms to the last bit, on every data-parallel rank and in
every run; the partials live in a scratch buffer per accumulator (`_scratch`)."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel
from nanoeuler.kernels.bf16 import grid_1d

i32, i64, f32 = np.int32, np.int64, np.float32

PARTS = 4096  # the most blocks an ordered sum adds up (its grid's size)
_SCRATCH: dict = {}  # {(device, accumulator address): partial sums, arrival counters}


def _scratch(acc, blocks: int) -> tuple:
    """(partial sums, arrival counters) of the ordered sums into `acc`, PARTS of each, for a grid of
    `blocks` blocks. One buffer per accumulator, zeroed on its first use (the kernels leave the counters
    at zero), so sums into different accumulators, on different streams say, never share one. The first
    use must not fall inside a CUDA graph's capture: the engine runs each of its steps kernel by kernel
    once before it captures it. Kept for the process's life: a captured graph may still point at it."""
    import cupy

    if blocks > PARTS:
        raise ValueError(f"an ordered sum over {blocks} blocks; at most {PARTS}")
    key = (acc.device.id, acc.data.ptr)
    if key not in _SCRATCH:
        buf = cupy.zeros(2 * PARTS, dtype=np.float32)
        _SCRATCH[key] = buf[:PARTS], buf[PARTS:].view(np.uint32)
    return _SCRATCH[key]


def sumsq(g, sq) -> None:
    """sq[0] += sum of g^2 (g flat float32), the same bits for the same g whatever the blocks' order."""
    n = g.size
    grid = min(PARTS, -(-n // 256))
    kernel("bf16/optim", "sumsq")((grid,), (256,), (g, i64(n), sq, *_scratch(sq, grid)))


def f32_to_bf16(x, y, gain, cols: int) -> None:
    """y = bf16(x * gain[i % cols]) (a null gain: bf16(x)); x flat float32."""
    n = x.size
    kernel("bf16/optim", "f32_to_bf16")(grid_1d(n), (256,), (x, y, i64(n), gain, i32(cols)))


def adamw_clip(
    p, g, m, v, pb, sq, hyper, decayed: bool, max_norm: float, beta1: float, beta2: float, eps: float, gain, cols: int
) -> None:
    """Clip g by sqrt(sq[0]) against max_norm, AdamW on one flat range (hyper: step size, 1/sqrt(1 - b2^t),
    decay factor, on the device), and the range's bf16 image pb = bf16(p * gain)."""
    n = p.size
    kernel("bf16/optim", "adamw_clip_bf16")(
        (min(4096, -(-n // 256)),),
        (256,),
        (
            p,
            g,
            m,
            v,
            pb,
            i64(n),
            sq,
            hyper,
            i32(decayed),
            f32(max_norm),
            f32(beta1),
            f32(beta2),
            f32(eps),
            gain,
            i32(cols),
        ),
    )


def grad_accumulate(g, acc, loss, loss_acc) -> None:
    """acc += g (flat float32) and loss_acc[0] += loss[0]: one micro-batch into the step's sums."""
    n = g.size
    kernel("bf16/optim", "grad_accumulate")((min(4096, -(-n // 1024)),), (256,), (g, acc, i64(n), loss, loss_acc))


def _layer_grid(n: int, layers: int) -> tuple:
    """(blocks over one matrix of n elements, layers): about 2048 blocks in all."""
    return (max(1, min(-(-n // 256), -(-2048 // layers))), layers)


def muon_momentum(g, m, x, n: int, stride: int, xstride: int, layers: int, ss, sq, max_norm: float, mu: float) -> None:
    """For each layer l: the clipped gradient's Nesterov momentum u (m updated in place) into the bf16
    matrix x[l*xstride:], and ss[l] += sum u^2 (in a fixed order). g, m: float32 from the layer-0 matrix,
    layers `stride` apart."""
    grid = _layer_grid(n, layers)
    kernel("bf16/optim", "muon_momentum")(
        grid,
        (256,),
        (g, m, x, i64(n), i64(stride), i64(xstride), ss, sq, f32(max_norm), f32(mu), *_scratch(ss, grid[0] * layers)),
    )


def muon_normalize(x, n: int, xstride: int, layers: int, ss) -> None:
    """Each layer's bf16 matrix x[l*xstride:][:n] divided by sqrt(ss[l]) (its Frobenius norm)."""
    kernel("bf16/optim", "muon_normalize")(_layer_grid(n, layers), (256,), (x, i64(n), i64(xstride), ss))


def muon_update(
    p,
    o,
    pb,
    n: int,
    stride: int,
    ostride: int,
    layers: int,
    hyper,
    decayed: bool,
    scale: float,
    gain,
    gstride: int,
    cols: int,
) -> None:
    """p = p * decay - lr * scale * o per layer (hyper: lr, -, decay on the device), and its bf16 image
    pb = bf16(p * gain) (gain: the layer-0 gain, layers `gstride` apart, or a null pointer)."""
    kernel("bf16/optim", "muon_update")(
        _layer_grid(n, layers),
        (256,),
        (p, o, pb, i64(n), i64(stride), i64(ostride), hyper, i32(decayed), f32(scale), gain, i64(gstride), i32(cols)),
    )


def muon_poly_init(a, b, m: int, count: int, ca: float, cb: float) -> None:
    """b = cb * a + ca * I for `count` packed m x m bf16 matrices (a Newton-Schulz step's linear terms)."""
    per_thread = 8 if m % 8 == 0 else 1  # 16-byte accesses where rows allow
    kernel("bf16/optim", "muon_poly_init")(
        _layer_grid(m * m // per_thread, count), (256,), (a, b, i64(m), i64(count), f32(ca), f32(cb))
    )
