"""`nanoeuler selftest`: every GPU kernel against its NumPy reference, in a table.

Each case draws fresh random inputs (the seed is printed; `--seed` repeats a run), runs the kernel on the
GPU and the reference layer (`nanoeuler.model.layers`, `nanoeuler.optim`) in float64 on the CPU on the
same rounded inputs, and compares every output by ||out - ref|| / ||ref|| (float64 norms; tolerance 1e-5
for float32, the bf16 cases' own in `selftest_bf16`). While a case runs, every new GPU allocation is
filled with NaN bytes, so an output element that a kernel forgets to write stays NaN, and NaN never
passes. Shapes include lengths that are not a multiple of the tiles, strided inputs, and KV-cache
decoding (S > T).

    $ nanoeuler selftest
    kernel                  shape                      rel err   tol      pass
    attention fwd out       B2 H12/4 T100 S100 D64 *   3.1e-07   1.0e-05  ok
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from dataclasses import dataclass

import numpy as np

from nanoeuler.backend import GPU_INSTALL_HINT, gpu_unavailable_reason, tf32_enabled
from nanoeuler.errors import UserError

TOL_FP32 = 1e-5


@dataclass
class Row:
    kernel: str
    shape: str
    err: float
    tol: float = TOL_FP32
    note: str = ""

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.err)) and self.err <= self.tol


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN when out holds any NaN/inf (never a pass)."""
    from nanoeuler.backend import to_numpy

    o = np.asarray(to_numpy(out), dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise AssertionError(f"shape {o.shape} != reference {r.shape}")
    if not np.isfinite(o).all():
        return float("nan")
    denom = np.linalg.norm(r)
    return float(np.linalg.norm(o - r) / (denom if denom > 0 else 1.0))


@contextlib.contextmanager
def poisoned_allocations():
    """Within the block every CuPy allocation starts as 0xFF bytes: NaN for float32, -1 for ints."""
    import cupy

    pool = cupy.get_default_memory_pool()

    def alloc(size):
        mem = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(alloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(pool.malloc)


# ---- inputs --------------------------------------------------------------------------------------


def _randn(rng, shape, scale=1.0):
    """Float32-representable values, as float64 (the reference sees exactly what the GPU sees)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)


def _gpu(a, dtype=np.float32):
    import cupy

    return cupy.asarray(np.asarray(a, dtype=dtype))


def _targets(rng, n, vocab, ignore=0.25):
    t = rng.integers(0, vocab, size=n)
    t[rng.random(n) < ignore] = -1
    t[0] = rng.integers(0, vocab)  # at least one valid row
    return t


# ---- cases: each returns [(label, gpu output, float64 reference), ...] ---------------------------


def case_rmsnorm(rng, shape):
    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    x = _randn(rng, shape, 2.0) + 0.5
    w = 1.0 + _randn(rng, shape[-1:], 0.3)
    dy = _randn(rng, shape)
    y, c = ops.rmsnorm_forward(_gpu(x), _gpu(w), 1e-5)
    dx, dw = ops.rmsnorm_backward(_gpu(dy), c)
    yr, cr = layers.rmsnorm_forward(x, w, 1e-5)
    dxr, dwr = layers.rmsnorm_backward(dy.copy(), cr)
    return [("rmsnorm fwd y", y, yr), ("rmsnorm bwd dx", dx, dxr), ("rmsnorm bwd dw", dw, dwr)]


def case_rope(rng, shape, strided=False, offset=0):
    import cupy

    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    B, H, T, D = shape
    x = _randn(rng, (B, T, H, D)).transpose(0, 2, 1, 3) if strided else _randn(rng, shape)
    dy = _randn(rng, shape)
    cos, sin = ops.rope_tables(T, D, 10000.0, cupy, np.float32, offset=offset)
    cr, sr = layers.rope_tables(T, D, 10000.0, np, np.float64, offset=offset)
    xg = _gpu(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) if strided else _gpu(x)
    y = ops.rope_forward(xg, cos, sin)
    dx = ops.rope_backward(_gpu(dy), cos, sin)
    return [("rope fwd", y, layers.rope_forward(x, cr, sr)), ("rope bwd", dx, layers.rope_backward(dy, cr, sr))]


def case_attention(rng, shape, strided=False):
    """shape (B, H, Hkv, T, S, D); strided: q/k/v as transposed views of (B,T,H,D) projections, and for
    S > T, k/v as the first S positions of larger KV-cache buffers."""
    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    B, H, Hkv, T, S, D = shape
    q = _randn(rng, (B, H, T, D), 1.5)
    k = _randn(rng, (B, Hkv, S, D), 1.5)
    v = _randn(rng, (B, Hkv, S, D))
    dout = _randn(rng, (B, H, T, D))
    if strided and S == T:
        qg = _gpu(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        kg = _gpu(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        vg = _gpu(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        dg = _gpu(dout.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    elif strided:
        import cupy

        qg, dg = _gpu(q), _gpu(dout)
        kb = cupy.full((B, Hkv, S + 11, D), cupy.nan, dtype=np.float32)
        vb = cupy.full((B, Hkv, S + 11, D), cupy.nan, dtype=np.float32)
        kb[:, :, :S] = _gpu(k)
        vb[:, :, :S] = _gpu(v)
        kg, vg = kb[:, :, :S], vb[:, :, :S]
    else:
        qg, kg, vg, dg = _gpu(q), _gpu(k), _gpu(v), _gpu(dout)
    out, c = ops.attention_forward(qg, kg, vg)
    dq, dk, dv = ops.attention_backward(dg, c)
    outr, cr = layers.attention_forward(q, k, v)
    dqr, dkr, dvr = layers.attention_backward(dout, cr)
    return [
        ("attention fwd out", out, outr),
        ("attention bwd dq", dq, dqr),
        ("attention bwd dk", dk, dkr),
        ("attention bwd dv", dv, dvr),
    ]


def case_swiglu(rng, shape, strided=False):
    """strided: g and u as the two halves of one (..., 2F) array, as a stacked gate/up GEMM gives them."""
    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    g = _randn(rng, shape, 3.0)
    u = _randn(rng, shape)
    dh = _randn(rng, shape)
    if strided:
        F = shape[-1]
        gu = _gpu(np.concatenate([g, u], axis=-1))
        gg, ug = gu[..., :F], gu[..., F:]
    else:
        gg, ug = _gpu(g), _gpu(u)
    h, c = ops.swiglu_forward(gg, ug)
    dg, du = ops.swiglu_backward(_gpu(dh), c)
    hr, cr = layers.swiglu_forward(g, u)
    dgr, dur = layers.swiglu_backward(dh, cr)
    return [("swiglu fwd", h, hr), ("swiglu bwd dg", dg, dgr), ("swiglu bwd du", du, dur)]


def case_cross_entropy(rng, shape):
    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    N, V = shape
    z = _randn(rng, shape, 3.0)
    t = _targets(rng, N, V)
    loss, n, c = ops.cross_entropy_forward(_gpu(z), _gpu(t, np.int64))
    lr, nr, cr = layers.cross_entropy_forward(z.copy(), t)
    if n != nr:
        raise AssertionError(f"n_valid {n} != reference {nr}")
    dz = ops.cross_entropy_backward(1.0 / n, c)
    dzr = layers.cross_entropy_backward(1.0 / nr, cr)
    return [("cross_entropy fwd loss", loss, lr), ("cross_entropy bwd dlogits", dz, dzr)]


def case_linear_ce(rng, shape):
    """shape (N, C, V, chunk_rows): the fused head + cross-entropy against linear + CE of `layers`."""
    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    N, C, V, chunk = shape
    x = _randn(rng, (N, C))
    w = _randn(rng, (V, C), 3.0 / np.sqrt(C))
    t = _targets(rng, N, V)
    nr = int((t >= 0).sum())
    loss, n, dx, dw = ops.linear_cross_entropy(_gpu(x), _gpu(w), _gpu(t, np.int64), 1.0 / nr, chunk_rows=chunk)
    loss_only, _, none_dx, _ = ops.linear_cross_entropy(_gpu(x), _gpu(w), _gpu(t, np.int64), chunk_rows=chunk)
    if n != nr or none_dx is not None:
        raise AssertionError(f"n_valid {n} != reference {nr}, or gradients without dloss_sum")
    lg = layers.linear_forward(x, w)
    lr, _, cr = layers.cross_entropy_forward(lg, t)
    dxr, dwr = layers.linear_backward(layers.cross_entropy_backward(1.0 / nr, cr), x, w)
    return [
        ("linear_cross_entropy loss", loss, lr),
        ("linear_cross_entropy loss (no grad)", loss_only, lr),
        ("linear_cross_entropy dx", dx, dxr),
        ("linear_cross_entropy dw", dw, dwr),
    ]


def _embedding_ids(rng, n, V, ids):
    """n token ids in [0, V): "random" (V < n: ids repeat), "hot" (one id at about 3/4 of the positions: a
    run of equal ids over many blocks' spans), "same" (every position one id), "distinct" (no repeats,
    V >= n), "ends" (only 0 and V-1)."""
    if ids == "random":
        return rng.integers(0, V, size=n)
    if ids == "hot":
        return np.where(rng.random(n) < 0.75, rng.integers(0, V), rng.integers(0, V, size=n))
    if ids == "same":
        return np.full(n, rng.integers(0, V))
    if ids == "distinct":
        return rng.permutation(V)[:n]
    if ids == "ends":
        return rng.permutation(np.resize([0, V - 1], n))
    raise ValueError(f"unknown ids pattern {ids!r}")


def case_embedding(rng, shape, ids="random"):
    """shape (B, T, V, C); `ids` one of `_embedding_ids`' patterns."""
    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    B, T, V, C = shape
    ids = _embedding_ids(rng, B * T, V, ids).reshape(B, T)
    w = _randn(rng, (V, C))
    dx = _randn(rng, (B, T, C))
    x = ops.embedding_forward(_gpu(ids, np.int64), _gpu(w))
    dw = ops.embedding_backward(_gpu(dx), _gpu(ids, np.int64), V)
    return [
        ("embedding fwd", x, layers.embedding_forward(ids, w)),
        ("embedding bwd dw", dw, layers.embedding_backward(dx, ids, V)),
    ]


def case_adamw(rng, shape):
    """shape (rows, cols, steps): a decayed matrix and an undecayed gain, several steps, vs optim.AdamW."""
    from nanoeuler.optim import AdamW

    rows, cols, steps = shape
    names = {"layers.0.mlp.up_proj.weight": (rows, cols), "layers.0.input_layernorm.weight": (cols,)}
    ref = {n: _randn(rng, s) for n, s in names.items()}
    dev = {n: _gpu(p) for n, p in ref.items()}
    opt_ref = AdamW(ref, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_dev = AdamW(dev, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(steps):
        grads = {n: _randn(rng, sh, 0.1) for n, sh in names.items()}
        lr = 1e-2 * (s + 1)
        opt_ref.step(ref, grads, lr)
        opt_dev.step(dev, {n: _gpu(g) for n, g in grads.items()}, lr)  # CuPy float32: the fused kernel
    if opt_dev.t != opt_ref.t:
        raise AssertionError(f"step count {opt_dev.t} != {opt_ref.t}")

    def cat(d):
        return np.concatenate([np.asarray(d[n].get() if hasattr(d[n], "get") else d[n]).ravel() for n in names])

    return [
        ("adamw param", cat(dev), cat(ref)),
        ("adamw m", cat(opt_dev.m), cat(opt_ref.m)),
        ("adamw v", cat(opt_dev.v), cat(opt_ref.v)),
    ]


# (function, shape, shape label, keyword arguments)
CASES = [
    (case_rmsnorm, (2, 37, 128), "B2 T37 C128", {}),
    (case_rmsnorm, (4, 129, 768), "B4 T129 C768", {}),
    (case_rmsnorm, (3, 1, 341), "B3 T1 C341", {}),
    (case_rope, (2, 4, 37, 32), "B2 H4 T37 D32", {}),
    (case_rope, (3, 12, 100, 64), "B3 H12 T100 D64 *", {"strided": True}),
    (case_rope, (2, 4, 5, 64), "B2 H4 T5 D64 pos100", {"offset": 100}),
    (case_attention, (2, 4, 2, 37, 37, 32), "B2 H4/2 T37 D32", {}),
    (case_attention, (2, 12, 4, 100, 100, 64), "B2 H12/4 T100 D64 *", {"strided": True}),
    (case_attention, (1, 12, 4, 300, 300, 64), "B1 H12/4 T300 D64", {}),
    (case_attention, (1, 4, 4, 129, 129, 32), "B1 H4/4 T129 D32", {}),
    (case_attention, (2, 4, 2, 5, 70, 64), "B2 H4/2 T5 S70 D64 *", {"strided": True}),
    (case_attention, (1, 2, 1, 1, 33, 32), "B1 H2/1 T1 S33 D32", {}),
    (case_attention, (1, 4, 2, 70, 70, 128), "B1 H4/2 T70 D128", {}),
    (case_attention, (1, 2, 1, 50, 50, 16), "B1 H2/1 T50 D16", {}),
    (case_swiglu, (2, 37, 341), "B2 T37 F341", {}),
    (case_swiglu, (3, 100, 2048), "B3 T100 F2048 *", {"strided": True}),
    (case_cross_entropy, (37, 512), "N37 V512", {}),
    (case_cross_entropy, (300, 4096), "N300 V4096", {}),
    (case_cross_entropy, (7, 100), "N7 V100", {}),
    (case_linear_ce, (300, 128, 512, 64), "N300 C128 V512 chunk64", {}),
    (case_linear_ce, (1000, 768, 4096, 384), "N1000 C768 V4096 chunk384", {}),
    (case_embedding, (2, 150, 50, 128), "B2 T150 V50 C128", {}),
    (case_embedding, (4, 300, 1000, 200), "B4 T300 V1000 C200 hot", {"ids": "hot"}),
    (case_embedding, (1, 77, 7, 33), "B1 T77 V7 C33 same", {"ids": "same"}),
    (case_embedding, (2, 64, 300, 96), "B2 T64 V300 C96 distinct", {"ids": "distinct"}),
    (case_embedding, (3, 50, 5000, 64), "B3 T50 V5000 C64 ends", {"ids": "ends"}),
    (case_adamw, (64, 33, 3), "64x33 + 33, 3 steps", {}),
    (case_adamw, (1000, 257, 2), "1000x257 + 257, 2 steps", {}),
]
# '*': strided inputs (transposed views, or KV-cache slices)


def all_cases():
    """The float32 cases, then the bf16 engine's (tolerance per row: 1e-2 for bf16 results), then the
    decode engine's (`selftest_decode`: a case per kernel family)."""
    from nanoeuler.checks.selftest_bf16 import CASES_BF16
    from nanoeuler.checks.selftest_decode import CASES_DECODE

    return CASES + CASES_BF16 + CASES_DECODE


def run_cases(seed: int, only: str | None = None, out=sys.stderr) -> list[Row]:
    rows: list[Row] = []
    for i, (fn, shape, label, kwargs) in enumerate(all_cases()):
        name = fn.__name__[len("case_") :]
        if only and only not in name:
            continue
        rng = np.random.default_rng([seed, i])
        try:
            with poisoned_allocations():
                results = fn(rng, shape, **kwargs)
                for kernel, got, ref, *tol in results:  # an optional 4th item: the row's tolerance
                    rows.append(Row(kernel, label, rel_err(got, ref), *tol))
        except Exception as exc:  # report and go on: one device run should show every failure
            traceback.print_exc(file=out)
            rows.append(Row(name, label, float("nan"), note=f"{type(exc).__name__}: {exc}".splitlines()[0][:80]))
    return rows


def format_table(rows: list[Row]) -> str:
    kw = max([len("kernel")] + [len(r.kernel) for r in rows])
    sw = max([len("shape")] + [len(r.shape) for r in rows])
    lines = [f"{'kernel':<{kw}}  {'shape':<{sw}}  {'rel err':>9}  {'tol':>7}  pass"]
    for r in rows:
        lines.append(
            f"{r.kernel:<{kw}}  {r.shape:<{sw}}  {r.err:>9.2e}  {r.tol:>7.0e}  "
            f"{'ok' if r.ok else 'FAIL'}{'  ' + r.note if r.note else ''}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: a fresh one)")
    parser.add_argument("--only", metavar="NAME", help="run only the cases whose kernel name contains NAME")


def run(args: argparse.Namespace) -> int:
    why = gpu_unavailable_reason()
    if why:  # one clear line: what is missing and how to install it
        raise UserError(f"the kernel self-test needs a CUDA GPU but {why}; {GPU_INSTALL_HINT}")
    if tf32_enabled():
        raise UserError(
            "CUPY_TF32 is set: cuBLAS would use TF32 (~1e-3) and the float32 checks (1e-5) "
            "mean nothing; unset CUPY_TF32"
        )
    import cupy

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    rows = run_cases(seed, args.only)
    if not rows:
        raise UserError(f"no self-test case matches --only {args.only!r}")
    print(
        f"selftest on {name} (sm_{dev.compute_capability}), CuPy {cupy.__version__}, seed {seed}; '*' = strided inputs"
    )
    print(format_table(rows))
    failed = sum(not r.ok for r in rows)
    print(f"{len(rows) - failed} of {len(rows)} passed" + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0
