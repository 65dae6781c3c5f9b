"""One round of the decode engine's A/B (scripts/gpu_decode_ab.sh runs it for each tree in turn): the
`nanoeuler` package on PYTHONPATH, timed on random `gpu`-preset weights, as one JSON line.

    PYTHONPATH=<tree> python bench/decode_ab_gpu.py --params p.npz [--cold]

Each figure is the median of --repeats runs: the batch-1 decode step, a verify pass (K rows, K heads) and
16-, 32- and 64-slot steps as their CUDA graphs replayed 50 times back to back; prefills of 16, 128 and 512 tokens as
`prefill` calls (graph, head, logits to the host). Also: the kernel nodes of the batch-1 step's graph, the
seconds GpuBackend takes to build (compiling every kernel where --cold gives CuPy an empty cache), and
greedy tokens, plain and speculative, for the outputs to be compared. Uses only what every version of
`GpuBackend` has (`_run`, `_graphs`, `start`, `prefill`, `stream`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np


def graph_nodes(graph) -> int | None:
    """Kernel nodes of a captured CuPy graph (CUDA driver: cuGraphGetNodes, cuGraphNodeGetType)."""
    ptr = getattr(graph, "graph", None)
    if ptr is None:
        return None
    lib = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_size_t(0)
    if lib.cuGraphGetNodes(ctypes.c_void_p(ptr), None, ctypes.byref(n)) != 0:
        return None
    nodes = (ctypes.c_void_p * n.value)()
    lib.cuGraphGetNodes(ctypes.c_void_p(ptr), nodes, ctypes.byref(n))
    kinds = [ctypes.c_int(0) for _ in range(n.value)]
    for node, kind in zip(nodes, kinds, strict=True):
        lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
    return sum(k.value == 0 for k in kinds)  # CU_GRAPH_NODE_TYPE_KERNEL


def replay_us(be, key, M, heads, meta, repeats, reps=50) -> tuple[float, object]:
    """Microseconds a replay of the pass's graph, recorded on the first calls."""
    for _ in range(3):  # kernel by kernel, recorded, replayed
        be._run(M, heads, "argmax", meta)
    be.stream.synchronize()
    g = be._graphs[key]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            g.launch(be.stream)
        be.stream.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return 1e6 * statistics.median(times), g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", required=True, help="an .npz of the model's float32 parameters (written if absent)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens of each output check")
    ap.add_argument("--cold", action="store_true", help="report the build time as the cold compile")
    args = ap.parse_args(argv)

    import os

    from nanoeuler.infer import engine as engine_mod
    from nanoeuler.infer.gpu import GpuBackend
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig

    cfg = ModelConfig.named("gpu")
    if os.path.exists(args.params):
        params = dict(np.load(args.params))
    else:
        params = transformer.init_params(cfg, seed=0)
        np.savez(args.params, **params)
    t0 = time.perf_counter()
    be = GpuBackend(params, cfg, dtype="bf16")
    be.stream.synchronize()
    build_s = time.perf_counter() - t0
    K, rng = cfg.mtp_heads, np.random.default_rng(0)
    out: dict = {"build_s": build_s, "cold": args.cold}
    be.start(1, [0])
    prompt = rng.integers(0, cfg.vocab_size, 256)
    be.prefill(0, prompt)
    pos = len(prompt)
    one = np.concatenate([[7], [0], [pos]]).astype(np.int32)
    out["step_us"], g = replay_us(be, (1, 1, "argmax"), 1, 1, one, args.repeats)
    out["step_kernels"] = graph_nodes(g)
    ver = np.concatenate([np.full(K, 7), np.zeros(K), pos + np.arange(K)]).astype(np.int32)
    out["verify_us"], g = replay_us(be, (K, K, "argmax"), K, K, ver, args.repeats)
    out["verify_kernels"] = graph_nodes(g)
    be.start(64, list(range(64)))
    for n in (16, 32, 64):  # the few-row GEMVs, their two row tiles (where the model allows), cuBLAS
        wide = np.concatenate([np.full(n, 7), np.arange(n), np.full(n, pos)]).astype(np.int32)
        out[f"batch{n}_us"], g = replay_us(be, (n, 1, "argmax"), n, 1, wide, args.repeats)
    out["batch64_nodes"] = graph_nodes(g)  # (cuBLAS adds its own kernels)
    be.start(1, [0])
    for T in (16, 128, 512):
        ids = rng.integers(0, cfg.vocab_size, T)
        for _ in range(3):
            be.prefill(0, ids)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for _ in range(10):
                be.prefill(0, ids)
            times.append((time.perf_counter() - t) / 10)
        out[f"prefill{T}_ms"] = 1e3 * statistics.median(times)
    # the outputs: greedy plain and speculative continuations of three prompts
    try:  # either side of the A/B: Sampling and the engine's class moved and were renamed
        from nanoeuler.infer.sampling import Sampling
    except ImportError:
        from nanoeuler.infer.generate import Sampling
    eng = getattr(engine_mod, "DecodeEngine", None) or engine_mod.Engine
    eng = eng(be, cfg)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (5, 16, 40)]
    greedy = Sampling(temperature=0.0)
    out["greedy"] = [list(map(int, s)) for s in eng.generate(prompts, args.tokens, greedy, speculative=False)]
    out["speculative"] = [list(map(int, eng.generate([p], args.tokens, greedy, speculative=True)[0])) for p in prompts]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
