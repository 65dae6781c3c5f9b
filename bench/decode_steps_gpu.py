"""The decode engine's forward passes alone, as the GPU runs them: CUDA-graph replay time by rows and position.

    python bench/decode_steps_gpu.py                         # random `gpu`-preset weights, bf16
    python bench/decode_steps_gpu.py --ckpt base.bin --only 4x4@256 --reps 3   # one pass, for a profiler

Each pass is one of the engine's recorded graphs (`GpuBackend._run`: embedding, every layer, the final
norm and heads, the argmax), replayed back to back with no host work: a decode step of M slots (one row
each, head 0), or a verify pass (K rows of one slot at consecutive positions, all K heads). Where it sits
in the cache matters: attention reads every earlier position, so each pass is timed at a few positions.
Medians over --repeats runs of 50 replays, after a warm-up. --variants times the same passes on backends
built other ways (a column each): `blockattn` (wide batches' attention a block per query head, as before
`attend_kv`), `nopdl` (ordinary launches), `ffma` (the float GEMV for 2 to 16 rows too, not the tensor-core one),
`nocluster` (one-row attention + o projection as attend_o: every block attends over all keys),
`separgmax` (a one-row step's head and its argmax as two kernels), `aloneN` (up to N keys every block of
attend_o_cluster's cluster attends over all of them; default 96), `wsN` (a cuBLAS workspace of N MiB for
the many-row passes' products, which lets cuBLAS split K). --profile prints each pass's kernel times by
name (with programmatic dependent launch a kernel's time includes its wait for the one before it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoeuler.model import transformer  # noqa: E402
from nanoeuler.model.config import ModelConfig  # noqa: E402

# (label, rows, heads, one slot?) of the passes the engine runs
PASSES = (
    ("step", 1, 1, False),
    ("verify", 0, 0, True),
    ("step", 4, 1, False),
    ("step", 16, 1, False),
    ("step", 32, 1, False),
    ("step", 64, 1, False),
)


def parse_only(spec: str, K: int):
    """'4x4@256' -> (rows 4, heads 4, position 256); a pass of K rows and K heads is a verify pass."""
    rows_heads, pos = spec.split("@")
    rows, heads = (int(v) for v in rows_heads.split("x"))
    return ("verify" if rows == heads == K and K > 1 else "step", rows, heads, rows == heads == K and K > 1), int(pos)


def pass_meta(rows: int, one_slot: bool, pos: int, token: int) -> np.ndarray:
    """ids, slots, positions of the pass's rows: one slot at pos, pos+1, ... or one row a slot at pos."""
    ids = np.full(rows, token, np.int32)
    if one_slot:
        return np.concatenate([ids, np.zeros(rows, np.int32), pos + np.arange(rows, dtype=np.int32)])
    return np.concatenate([ids, np.arange(rows, dtype=np.int32), np.full(rows, pos, np.int32)])


def replay_us(be, rows, heads, meta, reps, repeats):
    """Microseconds per replay of the pass's graph (recorded on the first calls)."""
    import cupy as cp

    for _ in range(3):  # kernel by kernel, recorded, replayed
        be._run(rows, heads, "argmax", meta)
    be.stream.synchronize()
    g = be._graphs[(rows, heads, "argmax")]
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            g.launch(be.stream)
        be.stream.synchronize()
        out.append(time.perf_counter() - t0)
    cp.cuda.Device().synchronize()
    return 1e6 * statistics.median(out) / reps


def profile_pass(be, rows, heads, title, reps=20, top=12):
    """Kernel time per replay of a recorded pass by kernel name (CUPTI through the PyTorch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.zeros(1, device="cuda")
    g = be._graphs[(rows, heads, "argmax")]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.launch(be.stream)
        be.stream.synchronize()
    rows_ = [
        ((getattr(ev, "device_time_total", 0.0) or 0.0) / reps, ev.count // reps, ev.key) for ev in prof.key_averages()
    ]
    rows_ = [r for r in rows_ if r[0] > 0]
    print(f"profile {title}: {sum(r[0] for r in rows_):.1f} us of kernels, {sum(r[1] for r in rows_)} kernels")
    for us, n, name in sorted(rows_, reverse=True)[:top]:
        print(f"  {us:8.1f} us  x{n:<3} {name[:100]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="model file (default: random weights of the `gpu` preset)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--positions", default="16,256,496", help="cache positions of the first row, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50, help="replays per timed run")
    ap.add_argument("--only", metavar="RxH@P", help="one pass: R rows, H heads at position P (for a profiler)")
    ap.add_argument("--rows", help="only the passes of these row counts, comma-separated (e.g. 1,4)")
    ap.add_argument(
        "--variants",
        default="default",
        help="comma-separated: default, blockattn, nopdl, ffma, nocluster, separgmax, aloneN, wsN",
    )
    ap.add_argument("--profile", action="store_true", help="also print each pass's kernels by time (CUPTI)")
    args = ap.parse_args(argv)

    import cupy as cp

    from nanoeuler import checkpoint
    from nanoeuler.infer.gpu import GpuBackend

    if args.ckpt:
        params, cfg, _ = checkpoint.load_model(args.ckpt)
    else:
        cfg = ModelConfig.named("gpu")
        params = transformer.init_params(cfg, seed=0)
    K = cfg.mtp_heads
    passes = [(label, rows or K, heads or K, one) for label, rows, heads, one in PASSES]
    positions = [int(p) for p in args.positions.split(",")]
    if args.rows:
        passes = [p for p in passes if str(p[1]) in args.rows.split(",")]
    if args.only:
        (label, rows, heads, one), pos = parse_only(args.only, K)
        passes, positions = [(label, rows, heads, one)], [pos]
    variants = args.variants.split(",")
    times: dict = {}
    for v in variants:
        if (
            v not in ("default", "blockattn", "nopdl", "ffma", "nocluster", "separgmax")
            and not (v.startswith("alone") and v[5:].isdigit())
            and not (v.startswith("ws") and v[2:].isdigit())
        ):
            raise SystemExit(f"unknown variant {v!r}")
        be = GpuBackend(params, cfg, dtype=args.dtype, pdl=False if v == "nopdl" else None)
        var = be.variants
        var.attend_kv = var.attend_kv and v != "blockattn"
        var.tensor_cores = v != "ffma"
        var.attend_cluster = var.attend_cluster and v != "nocluster"
        var.fuse_argmax = v != "separgmax"
        if v.startswith("alone"):
            var.alone_keys = int(v[5:])
        if v.startswith("ws"):
            from nanoeuler.kernels.cublas import Gemm

            be._gemm = Gemm(be.stream, workspace=int(v[2:]) << 20)
        for label, rows, heads, one in passes:
            be.start(1 if one else rows, list(range(1 if one else rows)))
            for pos in positions:
                if pos + (rows if one else 1) <= cfg.ctx_len:
                    us = replay_us(be, rows, heads, pass_meta(rows, one, pos, 7), args.reps, args.repeats)
                    times[(label, rows, heads, pos, v)] = us
                    if args.profile:
                        profile_pass(be, rows, heads, f"{label} {rows}x{heads}@{pos} {v}")
        del be
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(
        f"\n{dev}, {args.dtype}, model {cfg.n_params():,} parameters "
        f"({'trained: ' + args.ckpt if args.ckpt else 'random'}); us per pass (per row)"
    )
    print("| pass | rows | heads | position | " + " | ".join(variants) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(variants))
    for key in dict.fromkeys(k[:4] for k in times):
        rows = key[1]
        cells = [f"{times[key + (v,)]:.1f} ({times[key + (v,)] / rows:.1f})" for v in variants]
        print(f"| {key[0]} | {rows} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
