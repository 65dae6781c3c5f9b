"""Data-parallel training on the GPUs of one host: the world-1 identity, step timings, the all-reduce.

    python bench/parallel_gpu.py --ranks 1 identity               # NCCL path at world 1 == plain path?
    python bench/parallel_gpu.py --ranks 4 scale --rows 16x512,32x512 --json s4.json
    python bench/parallel_gpu.py --ranks 8 allreduce               # the 116M gradient buffer, ms and GB/s
    python bench/parallel_gpu.py --ranks 4 scale --preset gpu-270m --rows 8x512,32x512   # the ~270M model

`--ranks N` starts N copies of this script, one a GPU (RANK/WORLD_SIZE/LOCAL_RANK and a rendezvous file,
as `nanoeuler pretrain --gpus N` does); each builds the NCCL communicator of `nanoeuler.train.parallel`.
The model is the `gpu` preset (116,417,280 parameters; `--preset` another), random tokens, AdamW and
clipping at 1.0.

identity  world 1 only: the fp32 stepper and the bf16 engine, each once plainly and once through the
          data-parallel path (NCCL all-reduce in the grad_hook, the loss averaged), on the same batches;
          prints whether parameters, moments, losses and norms agree bit for bit, next to two plain runs
          (the baseline: where a path adds with atomics, two plain runs differ in the last bits too).
scale     ms per step (median after --warmup, host clock around a step, which waits for its loss) and
          tokens/s of the whole world, the bf16 engine through the data-parallel path; at world 1 also the
          plain engine (its CUDA graph), the baseline of the efficiency.
allreduce the NCCL average of a float32 buffer of the preset's size, in place: median of CUDA-event times,
          algorithm bandwidth (bytes / time) and bus bandwidth (x 2(N-1)/N, NCCL's convention).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoeuler.config import validate  # noqa: E402
from nanoeuler.model import transformer  # noqa: E402
from nanoeuler.model.config import ModelConfig  # noqa: E402
from nanoeuler.train import parallel  # noqa: E402
from nanoeuler.train.config import PretrainConfig  # noqa: E402
from nanoeuler.train.stepper import make_stepper  # noqa: E402


def settings(**kw) -> PretrainConfig:
    return PretrainConfig.from_section(dict(validate({})["pretrain"], **kw))


def batches(cfg: ModelConfig, B: int, T: int, n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w = rng.integers(0, cfg.vocab_size, size=(B, T + cfg.mtp_heads))
        y = np.stack([w[:, 1 + k : T + 1 + k] for k in range(cfg.mtp_heads)], axis=-1)
        out.append([(w[:, :T], y)])
    return out


def compare(a, b, data, lr=3e-4) -> dict:
    """Step two steppers on the same batches -> how far apart their losses, norms and state end."""
    import cupy as cp

    d_loss = d_norm = 0.0
    for batch in data:
        la, na = a.step(batch, lr)
        lb, nb = b.step(batch, lr)
        d_loss, d_norm = max(d_loss, abs(la - lb) / abs(la)), max(d_norm, abs(na - nb) / abs(na))
    ta = {**a.params(), **a.state_tensors()}
    tb = {**b.params(), **b.state_tensors()}
    equal = all(bool(cp.array_equal(ta[n], tb[n])) for n in ta)
    d_state = max(float(cp.max(cp.abs(ta[n] - tb[n]))) for n in ta)
    return {"steps": len(data), "loss_diff": d_loss, "norm_diff": d_norm, "bitwise": equal, "state_diff": d_state}


def hook_is_identity(dp, grads: dict) -> bool:
    """At world size 1 the all-reduce must leave the gradients exactly as they were."""
    import cupy as cp

    before = {n: g.copy() for n, g in grads.items()}
    dp.grad_hook()(grads)
    return all(bool(cp.array_equal(grads[n], before[n])) for n in grads)


def identity(dp, cfg) -> int:
    """The data-parallel path at world 1 against the plain one. The bf16 engine is not bit-reproducible
    (its embedding backward and the norm gains' squares add with atomics), so two plain runs are the baseline,
    and the all-reduce itself is checked alone on one backward's gradients: it must change no bit."""
    import cupy as cp

    assert dp.size == 1, "identity runs at world size 1"
    params = transformer.init_params(cfg, seed=0)
    rows, exact = [], {}
    s32 = settings(precision="fp32", grad_clip=1.0, batch_size=4)
    data = batches(cfg, 4, 256, 4, seed=1)
    dev = {n: cp.asarray(p) for n, p in params.items()}
    grads = transformer.loss_and_grads(dev, *map(cp.asarray, data[0][0]), cfg)[1]
    exact["fp32 gradients"] = hook_is_identity(dp, grads)
    del grads
    del dev
    plain, other = make_stepper(s32, cfg, params, cp), make_stepper(s32, cfg, params, cp)
    rows.append(("fp32 stepper, clip 1.0", "plain vs plain", compare(plain, other, data)))
    plain = make_stepper(s32, cfg, params, cp)
    nccl = dp.wrap(make_stepper(s32, cfg, params, cp, grad_hook=dp.grad_hook()))
    rows.append(("fp32 stepper, clip 1.0", "plain vs NCCL world 1", compare(plain, nccl, data)))
    del plain, other, nccl
    data = batches(cfg, 8, cfg.ctx_len, 8, seed=2)
    for clip in (0.0, 1.0):
        s16 = settings(precision="bf16", grad_clip=clip, batch_size=8)
        plain, other = make_stepper(s16, cfg, params, cp), make_stepper(s16, cfg, params, cp)
        rows.append((f"bf16 engine, clip {clip}", "plain vs plain", compare(plain, other, data)))
        del other
        plain = make_stepper(s16, cfg, params, cp)
        nccl = dp.wrap(make_stepper(s16, cfg, params, cp, grad_hook=dp.grad_hook()))
        if clip == 0.0:
            eng = nccl.inner.engine
            bufs = parallel.gradient_buffers(eng.grads())
            print(f"the engine's gradients: {len(bufs)} NCCL buffer(s), {sum(b.size for b in bufs):,} float32")
            eng.forward_backward(*(np.asarray(v, dtype=np.int32) for v in data[0][0]))
            exact["bf16 engine's flat gradients"] = hook_is_identity(dp, eng.grads())
        rows.append((f"bf16 engine, clip {clip}", "plain vs NCCL world 1", compare(plain, nccl, data)))
        del plain, nccl
        cp.get_default_memory_pool().free_all_blocks()
    print(f"\n{'what':<24} {'pair':<22} {'steps':>5} {'rel dloss':>10} {'rel dnorm':>10} {'max dstate':>10} bitwise")
    for what, pair, r in rows:
        print(
            f"{what:<24} {pair:<22} {r['steps']:>5} {r['loss_diff']:>10.3g} {r['norm_diff']:>10.3g} "
            f"{r['state_diff']:>10.3g} {'yes' if r['bitwise'] else 'NO'}"
        )
    ok = all(exact.values())
    for what, same in exact.items():
        print(f"all-reduce at world 1 on the {what}: {'bit for bit unchanged' if same else 'CHANGED (FAIL)'}")
    for what in dict.fromkeys(w for w, _, _ in rows):
        base, got = (r for w, _, r in rows if w == what)
        # end to end: bit for bit, or within the loss agreement of two plain runs (1e-4 relative at most)
        if got["bitwise"]:
            verdict = "bit for bit"
        elif got["loss_diff"] <= max(10 * base["loss_diff"], 1e-6) and got["loss_diff"] <= 1e-4:
            verdict = "losses as close as two plain runs' (the plain path is not bit-reproducible)"
        else:
            verdict, ok = "FAIL", False
        print(f"{what}: NCCL world 1 vs plain: {verdict}")
    return 0 if ok else 1


def time_steps(stepper, data, warmup: int) -> float:
    times = []
    for i, batch in enumerate(data):
        t0 = time.perf_counter()
        stepper.step(batch, 3e-4)  # reads the loss: waits for the step
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def scale(dp, cfg, rows: str, steps: int, warmup: int, json_path: str | None) -> None:
    import cupy as cp

    params = transformer.init_params(cfg, seed=0)
    out = []
    for row in rows.split(","):
        B, T = (int(v) for v in row.split("x"))
        c = dataclasses.replace(cfg, ctx_len=T)
        s16 = settings(precision="bf16", grad_clip=1.0, batch_size=B)
        data = batches(c, B, T, warmup + steps, seed=10 + dp.rank)
        modes = [("data-parallel", lambda: dp.wrap(make_stepper(s16, c, params, cp, grad_hook=dp.grad_hook())))]
        if dp.size == 1:
            modes.insert(0, ("plain", lambda: make_stepper(s16, c, params, cp)))
        for mode, build in modes:
            ms = time_steps(build(), data, warmup)
            cp.get_default_memory_pool().free_all_blocks()
            rec = {"world": dp.size, "B": B, "T": T, "mode": mode, "ms": ms, "tokens_per_s": dp.size * B * T / ms * 1e3}
            out.append(rec)
            if dp.is_root:
                print(
                    f"world {dp.size} B{B}xT{T} {mode:<13} {ms:8.2f} ms/step {rec['tokens_per_s']:>12,.0f} tokens/s",
                    flush=True,
                )
    if dp.is_root and json_path:
        Path(json_path).write_text(json.dumps(out))


def allreduce(dp, cfg, reps: int = 20) -> None:
    import cupy as cp

    buf = cp.ones(cfg.n_params(), dtype=cp.float32)
    times = []
    for i in range(reps + 5):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        dp.comm.all_reduce_mean([buf])
        e1.record()
        e1.synchronize()
        if i >= 5:
            times.append(cp.cuda.get_elapsed_time(e0, e1))
    assert bool(cp.all(buf == 1)), "the average of ones is not one"
    ms = statistics.median(times)
    algbw = buf.nbytes / ms / 1e6
    busbw = algbw * 2 * (dp.size - 1) / dp.size
    if dp.is_root:
        print(
            f"allreduce world {dp.size}: {buf.size:,} float32 ({buf.nbytes / 2**20:.0f} MiB) median {ms:.3f} ms "
            f"(min {min(times):.3f}), algbw {algbw:.1f} GB/s, busbw {busbw:.1f} GB/s",
            flush=True,
        )


def spawn(n: int, argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="nanoeuler-bench-") as tmp:
        procs = [
            subprocess.Popen([sys.executable, __file__, *argv], env=parallel.rank_env(r, n, str(Path(tmp) / "nccl.id")))
            for r in range(n)
        ]
        return parallel.supervise("bench", procs, hint="")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1, help="processes, one a GPU (default 1)")
    p.add_argument("what", choices=["identity", "scale", "allreduce"])
    p.add_argument("--rows", default="16x512,32x512", help="BxT per GPU, comma-separated")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", help="write the scale rows here (rank 0)")
    p.add_argument("--preset", default="gpu", help="the model preset (default gpu, the 116M)")
    args = p.parse_args(argv)
    if parallel.world_from_env() is None:
        return spawn(args.ranks, argv)
    dp = parallel.setup("bench", args.ranks, "gpu")
    cfg = ModelConfig.named(args.preset)
    if dp.is_root:
        import cupy as cp

        name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(
            f"{args.what} on {dp.size} x {name}, NCCL {getattr(cp.cuda.nccl, 'get_version', lambda: '?')()}, "
            f"{cfg.n_params():,} parameters",
            flush=True,
        )
    rc = {
        "identity": lambda: identity(dp, cfg),
        "allreduce": lambda: allreduce(dp, cfg),
        "scale": lambda: scale(dp, cfg, args.rows, args.steps, args.warmup, args.json),
    }[args.what]()
    dp.close()
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
