"""The fp32 token-embedding backward alone on one GPU: ours (kernels/ops.py `embedding_backward`: a sort of
the B*T keys id * B*T + position, then `embedding_bwd` adding each id's rows in position order) against a
float atomicAdd scatter (`cupyx.scatter_add`, what the kernel did before), same inputs, same process.

    python bench/embedding_gpu.py                 # V 50304, C 768 (the `gpu` preset), B16 x T512 and T1024

Ids are uniform (random tokens, as `checks.trainbench` feeds) or Zipf-distributed (a = 1.1: the commonest
id at ~9% of the positions, long runs of one id, as a text's commonest tokens make). Both sides
allocate and zero dw (V x C floats, ~150 MB) on every call, as the step does. Each runs 3 times, then 20
timed samples of 10 back-to-back calls between CUDA events; medians. `same bits` calls each 5 times on one
input and says whether every dw is equal to the first, bit for bit; `max diff` is the largest |ours - atomic|.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention_gpu import timed  # noqa: E402

V, C = 50304, 768


def atomic_backward(dx, ids, vocab):
    """The baseline: dw[ids[n]] += dx[n] with one float atomicAdd per element."""
    import cupy
    import cupyx

    dw = cupy.zeros((vocab, dx.shape[-1]), dtype=np.float32)
    cupyx.scatter_add(dw, ids.reshape(-1), dx.reshape(-1, dx.shape[-1]))
    return dw


def same_bits(fn, dx, ids) -> bool:
    first = fn(dx, ids, V)
    return all(bool((fn(dx, ids, V) == first).all()) for _ in range(4))


def main() -> int:
    import cupy

    from nanoeuler.kernels import ops

    rng = np.random.default_rng(0)
    head = f"{'ids':<8} {'B x T':<9} {'atomic ms':>9} {'ours ms':>8} {'ratio':>6} {'max diff':>9}"
    print(head + "  same bits (atomic / ours)")
    for kind, B, T in (("uniform", 16, 512), ("zipf", 16, 512), ("zipf", 16, 1024)):
        n = B * T
        ids = rng.integers(0, V, n) if kind == "uniform" else np.minimum(rng.zipf(1.1, n) - 1, V - 1)
        ids = cupy.asarray(ids.reshape(B, T))
        dx = cupy.asarray(rng.standard_normal((B, T, C)), dtype=np.float32)
        diff = float(abs(ops.embedding_backward(dx, ids, V) - atomic_backward(dx, ids, V)).max())
        ta = timed(lambda: atomic_backward(dx, ids, V), inner=10)
        to = timed(lambda: ops.embedding_backward(dx, ids, V), inner=10)
        sa, so = same_bits(atomic_backward, dx, ids), same_bits(ops.embedding_backward, dx, ids)
        print(f"{kind:<8} {f'{B}x{T}':<9} {ta:>9.3f} {to:>8.3f} {to / ta:>6.2f} {diff:>9.1e}  {sa} / {so}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
