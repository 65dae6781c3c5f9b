"""Time to first token with and without prefix reuse, engine only: requests whose prompts share a long head.

    python bench/prefix_ttft.py                        # the `small` preset (context 512), 400 shared tokens
    python bench/prefix_ttft.py --preset gpu --repeats 3   # the 116M model on the CPU
    python bench/prefix_ttft.py --preset gpu --device gpu  # the 116M model in bf16 on a GPU

Each request is a 400-token shared prefix (a system prompt, a few-shot block) and a 16-token question of
its own. A request's time to first token is `Backend.open` plus its first `step` (the prefill and the first
sampled token), one request at a time on a server backend with one slot; with reuse, one request first puts
the prefix in the cache (not timed). Prints the median over --repeats requests each way and their ratio
(the target: <= 0.3x). The weights are random: the arithmetic is the same as a trained model's. No HTTP:
this is the engine's share of a served request's time to first token. --profile: a cProfile of the timed
requests with reuse (on the GPU, the host's waits for the device show in the backend's fetches).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as bench/serve_load.py: a few shared cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402


def backend(preset: str, prefix_cache: int, device: str = "cpu"):
    """A one-slot server backend over a random-weight model of `preset`, its context at least 512 (bf16 weights
    on the GPU)."""
    import dataclasses

    from nanoeuler.infer.engine import DecodeEngine
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import init_params
    from nanoeuler.serve.backend import Backend

    cfg = ModelConfig.named(preset)
    cfg = dataclasses.replace(cfg, ctx_len=max(cfg.ctx_len, 512))
    tok = type("Tok", (), {"end_id": cfg.vocab_size - 1, "eot_id": cfg.vocab_size - 2})()
    kw = {"dtype": "bf16"} if device == "gpu" else {}
    return Backend(DecodeEngine.from_params(init_params(cfg, 0), cfg, device, **kw), tok, preset, 1, prefix_cache)


def ttft(be, prompt) -> float:
    from nanoeuler.infer.sampling import Sampling

    t0 = time.perf_counter()
    stream = be.open(prompt, 1, Sampling(temperature=0), stop_at_end=False)
    be.step([stream])
    seconds = time.perf_counter() - t0
    stream.close()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prefix", type=int, default=400, help="shared prompt tokens")
    ap.add_argument("--suffix", type=int, default=16, help="each request's own tokens")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--profile", action="store_true", help="cProfile the timed requests with reuse")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    plain, reuse = backend(args.preset, 0, args.device), backend(args.preset, 8, args.device)
    V = plain.cfg.vocab_size - 2
    head = rng.integers(0, V, args.prefix).tolist()
    prompts = [head + rng.integers(0, V, args.suffix).tolist() for _ in range(args.repeats + 1)]
    for _ in range(3):  # warm-up (a GPU records its graphs at the second call); the prefix into the cache
        ttft(plain, prompts[0])
        ttft(reuse, prompts[0])
    without = [ttft(plain, p) for p in prompts[1:]]
    copied = reuse.prefixes.tokens
    profile = cProfile.Profile() if args.profile else None
    if profile:
        profile.enable()
    with_ = [ttft(reuse, p) for p in prompts[1:]]
    if profile:
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    a, b = statistics.median(without), statistics.median(with_)
    print(
        f"{args.preset} (dim {plain.cfg.dim}, {plain.cfg.n_layers} layers) on the {args.device}, {args.prefix} shared"
        f" + {args.suffix} "
        f"own tokens, BLAS threads {os.environ['OPENBLAS_NUM_THREADS']}, median of {args.repeats}"
    )
    print(f"time to first token without reuse  {a * 1e3:8.1f} ms")
    print(
        f"time to first token with reuse     {b * 1e3:8.1f} ms   ({(reuse.prefixes.tokens - copied) // args.repeats} "
        f"positions copied per request)"
    )
    print(f"ratio                              {b / a:8.3f}x   (target <= 0.3x)")
    return 0 if b / a <= 0.3 else 1


if __name__ == "__main__":
    sys.exit(main())
