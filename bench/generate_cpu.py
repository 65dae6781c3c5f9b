"""Generation speed on the CPU: our NumPy decode engine against PyTorch eager with a KV cache, same weights,
with the memory-bandwidth bound of a decode step measured in the same run.

    python bench/generate_cpu.py                                  # `small` and the 116M `gpu` preset, random
    python bench/generate_cpu.py --presets small --ckpt small.bin # a trained model file
    python bench/generate_cpu.py --profile                        # + where a decode step's and a prefill's time goes
    LLAMA_BENCH=~/llama.cpp/build/bin/llama-bench python bench/generate_cpu.py --gguf gpu=m-f32.gguf

For each model: batch 1, greedy, a 16-token prompt and --new-tokens new ones (capped by the context, so
nobody slides a window), and a --prefill-token prompt (capped at the context) fed at once. The runs are
interleaved (one of each in turn, --repeats rounds after a warm-up round) and the medians compared, so a
shared machine's load hits every row alike; the load average is printed.

Rows: ours plain; ours by default (greedy: speculation only where the run measures that it pays,
`engine._adaptive`); ours with speculation forced on; PyTorch eager, the identical architecture in torch
(stacked q/k/v and gate/up weights, RMSNorm, RoPE, grouped-query attention over a preallocated cache,
SwiGLU, head 0) under inference_mode with torch.set_num_threads(--threads), which must produce our tokens;
llama.cpp's llama-bench where LLAMA_BENCH (or --llama-bench) names it and --gguf gives the model converted
to GGUF (docs/benchmarks-log.md says how to build and convert).

Prefill rows: ours on --threads workers and on one (`CpuBackend._rows_long`), PyTorch eager, llama.cpp; its
GFLOP/s are the layers' matrix products (2 x their weights x tokens) over the call's whole time.

The bound: a plain step must read every weight it uses once (the stacked layer matrices and head 0). The
same one-row products over exactly those matrices, with nothing else, give the machine's GEMV bandwidth and
the step time it implies; "of bound" is ours plain against it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoeuler.infer import cpu as cpu_mod  # noqa: E402
from nanoeuler.infer.engine import DecodeEngine  # noqa: E402
from nanoeuler.infer.sampling import Sampling  # noqa: E402
from nanoeuler.model import transformer  # noqa: E402
from nanoeuler.model.config import ModelConfig  # noqa: E402
from nanoeuler.model.layers import rope_tables  # noqa: E402

GREEDY = Sampling(temperature=0.0)


def interleaved(fns: dict, repeats: int, pause: float = 0.3) -> dict:
    """Median seconds of each fn, run in turn: a warm-up round, then `repeats` rounds, each starting one
    further down the list (no run always follows the same one). A pause before each run lets the thread
    pools of the one before stop spinning (OpenBLAS's workers spin for about 0.1 s after a threaded
    product, on the cores the next run needs)."""
    times = defaultdict(list)
    order = list(fns.items())
    for r in range(repeats + 1):
        for name, fn in order[r % len(order) :] + order[: r % len(order)]:
            time.sleep(pause)
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def torch_model(params, cfg):
    """(greedy(prompt, n) -> ids, prefill(prompt) -> None): the model in torch, eager, preallocated KV cache."""
    import torch

    T = lambda a: torch.tensor(np.asarray(a, dtype=np.float32))  # noqa: E731
    H, Hkv, D, F, L = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden, cfg.ctx_len
    G = H // Hkv
    lay = []
    for i in range(cfg.n_layers):
        g = lambda n: params[f"layers.{i}.{n}"]  # noqa: E731
        lay.append(
            (
                T(g("input_layernorm.weight")),
                T(np.concatenate([g(f"self_attn.{w}_proj.weight") for w in "qkv"])),
                T(g("self_attn.o_proj.weight")),
                T(g("post_attention_layernorm.weight")),
                T(np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])),
                T(g("mlp.down_proj.weight")),
            )
        )
    emb, norm, head = T(params["embed_tokens.weight"]), T(params["norm.weight"]), T(params["lm_head.weight"])
    cos, sin = (T(a) for a in rope_tables(L, D, cfg.rope_theta, np, np.float32))
    kc = torch.zeros(cfg.n_layers, Hkv, L, D)
    vc = torch.zeros(cfg.n_layers, Hkv, L, D)
    eps = cfg.norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, c, s):  # x (t, heads, D)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def forward(ids, start):
        t = ids.shape[0]
        x = emb[ids]
        c, s = cos[start : start + t, None], sin[start : start + t, None]
        mask = torch.ones(t, start + t, dtype=torch.bool).tril(start)
        for li, (n1, wqkv, wo, n2, wgu, wd) in enumerate(lay):
            qkv = rms(x, n1) @ wqkv.T
            q = rope(qkv[:, : H * D].view(t, H, D), c, s)
            kc[li, :, start : start + t] = rope(qkv[:, H * D : (H + Hkv) * D].view(t, Hkv, D), c, s).transpose(0, 1)
            vc[li, :, start : start + t] = qkv[:, (H + Hkv) * D :].view(t, Hkv, D).transpose(0, 1)
            k, v = kc[li, :, : start + t], vc[li, :, : start + t]  # (Hkv, S, D)
            qg = q.view(t, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, t * G, D) / D**0.5
            sc = (qg @ k.transpose(1, 2)).view(Hkv, t, G, start + t).masked_fill(~mask[:, None], float("-inf"))
            a = (sc.softmax(-1).view(Hkv, t * G, start + t) @ v).view(Hkv, t, G, D).permute(1, 0, 2, 3)
            x = x + a.reshape(t, H * D) @ wo.T
            gu = rms(x, n2) @ wgu.T
            x = x + (torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]) @ wd.T
        return rms(x[-1:], norm) @ head.T

    def greedy(prompt, n):
        with torch.inference_mode():
            out = []
            tok = int(forward(torch.tensor(prompt), 0).argmax())
            pos = len(prompt)
            for _ in range(n):
                out.append(tok)
                if len(out) == n:
                    break
                tok = int(forward(torch.tensor([tok]), pos).argmax())
                pos += 1
            return out

    def prefill(prompt):
        with torch.inference_mode():
            forward(torch.tensor(prompt), 0)

    return greedy, prefill


def gemv_sweep(be, threads=1):
    """fn() doing the one-row products of a plain step over its weights and nothing else, BLAS on `threads`
    threads; their bytes."""
    mats = [w[k] for w in be.layers for k in ("qkv_t", "o_t", "gu_t", "down_t")] + [be.head0_t]
    xs = [np.ones(m.shape[0], dtype=m.dtype) for m in mats]

    def sweep():
        before = cpu_mod.blas_threads(threads)
        for x, m in zip(xs, mats):
            x @ m
        if before:
            cpu_mod.blas_threads(before)

    return sweep, sum(m.nbytes for m in mats)


@contextlib.contextmanager
def kernel_timers(be):
    """Seconds by kernel while inside: the backend's functions wrapped with timers (a few microseconds a
    call, counted under the rest). Matrix products are named by weight, GEMV for one row, GEMM for more."""
    names = {}
    for w in be.layers:
        names.update(
            {id(w["qkv_t"]): "q/k/v", id(w["o_t"]): "o_proj", id(w["gu_t"]): "gate/up", id(w["down_t"]): "down"}
        )
    names[id(be.head0_t)] = "head 0"
    acc = defaultdict(float)

    def timed(fn, label):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label(*a) if callable(label) else label] += time.perf_counter() - t0

        return run

    def mm_label(x, w):
        return f"{'GEMV' if x.shape[0] == 1 else 'GEMM'} {names.get(id(w), 'output heads')}"

    cls = type(be)
    saved = dict(mm=cpu_mod._mm, rms=cpu_mod._rmsnorm, silu=cpu_mod._silu_mul, sample=cpu_mod.sample_token)
    saved_cls = dict(attend=cls._attend, causal=cls._attend_causal, rope=cls._rope)
    cpu_mod._mm = timed(saved["mm"], mm_label)
    cpu_mod._rmsnorm = timed(saved["rms"], "RMSNorm")
    cpu_mod._silu_mul = timed(saved["silu"], "SwiGLU")
    cpu_mod.sample_token = timed(saved["sample"], "sampling (argmax)")
    cls._attend = timed(saved_cls["attend"], "attention over the cache")
    cls._attend_causal = timed(saved_cls["causal"], "causal attention (chunks)")
    cls._rope = staticmethod(timed(saved_cls["rope"], "RoPE"))
    try:
        yield acc
    finally:
        cpu_mod._mm, cpu_mod._rmsnorm, cpu_mod._silu_mul = saved["mm"], saved["rms"], saved["silu"]
        cpu_mod.sample_token = saved["sample"]
        cls._attend, cls._attend_causal = saved_cls["attend"], saved_cls["causal"]
        cls._rope = staticmethod(saved_cls["rope"])


def by_kernel(acc, total, n) -> list[tuple[str, float]]:
    """(kernel, ms per n) rows, largest first, then the rest and the total."""
    rows = sorted(((k, v * 1e3 / n) for k, v in acc.items()), key=lambda kv: -kv[1])
    rest = total - sum(acc.values())
    return rows + [
        ("Python and the rest (residual adds, cache writes, embedding)", rest * 1e3 / n),
        ("total", total * 1e3 / n),
    ]


def profile_step(eng, prompt, steps: int) -> list[tuple[str, float]]:
    """Milliseconds per plain decode step by kernel, over `steps` steps after the prompt."""
    be = eng.backend
    with kernel_timers(be) as acc:
        be.start(1)
        tok = int(be.prefill(0, prompt)[0].argmax())
        acc.clear()
        t0 = time.perf_counter()
        for i in range(steps):
            tok = int(be.decode(np.array([tok]), np.array([len(prompt) + i]), GREEDY, i, [None], np.ones(1, bool))[0])
        total = time.perf_counter() - t0
    return by_kernel(acc, total, steps)


def prefill_on(be, ids, threads: int):
    """fn() prefilling ids into slot 0 with the backend's long calls on `threads` workers."""

    def run():
        saved, be.threads = be.threads, threads
        try:
            be.start(1)
            be.prefill(0, ids)
        finally:
            be.threads = saved

    return run


def profile_prefill(be, ids) -> list[tuple[str, float]]:
    """Milliseconds of one prefill by kernel, on one worker (one thread: the kernels' times add up to the
    call's; on several workers each runs its share of the same kernels)."""
    run = prefill_on(be, ids, 1)
    run()  # warm-up
    with kernel_timers(be) as acc:
        t0 = time.perf_counter()
        run()
        total = time.perf_counter() - t0
    return by_kernel(acc, total, 1)


def gemm_flops(cfg, tokens: int) -> float:
    """A prefill's matrix-product FLOPs: 2 x the layers' weights x tokens (the heads read one row only)."""
    C, F, H, Hkv, D = cfg.dim, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    per_layer = C * (H + 2 * Hkv) * D + H * D * C + C * 2 * F + F * C
    return 2.0 * cfg.n_layers * per_layer * tokens


def llama_bench(exe: str, gguf: str, threads: int, prefill: int, new: int) -> dict:
    """{'decode': tok/s, 'prefill': tok/s} from llama.cpp's llama-bench (JSON output), or {} if it fails."""
    cmd = [exe, "-m", gguf, "-t", str(threads), "-p", str(prefill), "-n", str(new), "-r", "3", "-o", "json"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        out = {}
        for row in json.loads(res.stdout):
            out["prefill" if row.get("n_prompt") else "decode"] = float(row["avg_ts"])
        return out
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        print(f"llama-bench failed ({' '.join(cmd)}): {exc}", file=sys.stderr)
        return {}


def bench_model(name, params, cfg, args, prompt_text_ids=None):
    import torch

    new = min(args.new_tokens, cfg.ctx_len - args.prompt_len)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)]
    if prompt_text_ids:
        prompt = (prompt_text_ids * args.prompt_len)[: args.prompt_len]
    long = [int(t) for t in rng.integers(0, cfg.vocab_size, min(args.prefill_tokens, cfg.ctx_len))]

    eng = DecodeEngine.from_params(params, cfg, "cpu", threads=args.threads)
    be = eng.backend
    t_greedy, t_prefill = torch_model(params, cfg)
    ours = list(eng.stream(prompt, new, GREEDY, speculative=False))
    same = ours == t_greedy(prompt, new)
    sweep, nbytes = gemv_sweep(be)
    sweep_mt, _ = gemv_sweep(be, args.threads)

    stats = {}

    def run_spec(key, spec):
        def fn():
            eng.stats = type(eng.stats)()
            list(eng.stream(prompt, new, GREEDY, speculative=spec))
            stats[key] = eng.stats

        return fn

    load0 = os.getloadavg()[0]

    def torch_on(threads, fn, *a):
        def run():
            torch.set_num_threads(threads)
            fn(*a)

        return run

    one = args.threads != 1  # PyTorch on one thread too: on a loaded machine its pool waits for cores
    t = interleaved(
        {
            "plain": lambda: list(eng.stream(prompt, new, GREEDY, speculative=False)),
            "default": run_spec("default", None),
            "spec": run_spec("spec", True),
            "torch": torch_on(args.threads, t_greedy, prompt, new),
            **({"torch1": torch_on(1, t_greedy, prompt, new)} if one else {}),
            "gemv": sweep,
            **({"gemv_mt": sweep_mt} if one else {}),
            "prefill": prefill_on(be, long, args.threads),
            **({"prefill1": prefill_on(be, long, 1)} if one else {}),
            "torch_prefill": torch_on(args.threads, t_prefill, long),
        },
        args.repeats,
    )
    torch.set_num_threads(args.threads)
    load1 = os.getloadavg()[0]
    best = min(t["gemv"], t.get("gemv_mt", np.inf))
    bound = 1.0 / best  # steps a second if a step were its weights' GEMVs alone, on the faster thread count

    def note(st):
        return f"{st.tokens_per_pass():.2f} tok/pass, {st.passes} passes, {st.plain} plain steps; heads " + " ".join(
            f"{a:.2f}" for a in st.acceptance()
        )

    dec = [
        ("ours plain (NumPy float32)", new / t["plain"], ""),
        ("ours default (adaptive speculation)", new / t["default"], note(stats["default"])),
        ("ours speculative, forced", new / t["spec"], note(stats["spec"])),
        (f"PyTorch {torch.__version__} eager, KV cache", new / t["torch"], f"{args.threads} threads"),
    ]
    if one:
        dec.append(("PyTorch eager, KV cache, 1 thread", new / t["torch1"], ""))
    pre = [(f"ours (NumPy float32), --threads {args.threads}", len(long) / t["prefill"])]
    if one:
        pre.append(("ours, --threads 1", len(long) / t["prefill1"]))
    pre.append(("PyTorch eager", len(long) / t["torch_prefill"]))
    gguf = dict(g.split("=", 1) for g in args.gguf).get(name)
    exe = args.llama_bench or os.environ.get("LLAMA_BENCH")
    if exe and gguf:
        lb = llama_bench(exe, gguf, args.threads, len(long), new)
        if "decode" in lb:
            dec.append((f"llama.cpp llama-bench ({Path(gguf).name})", lb["decode"], "its own timing, not interleaved"))
        if "prefill" in lb:
            pre.append((f"llama.cpp llama-bench ({Path(gguf).name})", lb["prefill"]))

    print(
        f"\n### {name}: {cfg.n_params():,} parameters ({args.ckpt or 'random weights'}), float32, "
        f"{args.threads} threads, load average {load0:.2f} -> {load1:.2f}"
    )
    mt = f", {nbytes / t['gemv_mt'] / 1e9:.1f} GB/s on {args.threads}" if one else ""
    print(
        f"GEMV bandwidth (the plain step's {len(be.layers) * 4 + 1} weight matrices, {nbytes / 1e6:.0f} MB, "
        f"one-row products alone): {nbytes / t['gemv'] / 1e9:.1f} GB/s on one thread{mt} -> bound "
        f"{bound:,.1f} tokens/s"
    )
    print(f"\nDecode: 16-token prompt, {new} new tokens greedy, median of {args.repeats} interleaved")
    print("| run | tokens/s | ms/token | vs PyTorch (its faster row) | of bound | notes |")
    print("|---|---:|---:|---:|---:|---|")
    peer = new / min(t["torch"], t.get("torch1", np.inf))
    for label, tps, n in dec:
        print(f"| {label} | {tps:,.1f} | {1e3 / tps:.2f} | {tps / peer:.2f}x | {tps / bound:.0%} | {n} |")
    print(f"greedy tokens, ours vs PyTorch: {'identical' if same else 'DIFFERENT'}")
    flops = gemm_flops(cfg, len(long))
    print(
        f"\nPrefill: {len(long)}-token prompt, median of {args.repeats} interleaved; GFLOP/s: the GEMMs' "
        f"{flops / 1e9:.1f} GFLOP (2 x layer weights x tokens) over the whole call"
    )
    print("| run | tokens/s | ms | GFLOP/s | vs PyTorch |")
    print("|---|---:|---:|---:|---:|")
    peer = len(long) / t["torch_prefill"]
    for label, tps in pre:
        ms = len(long) / tps * 1e3
        print(f"| {label} | {tps:,.0f} | {ms:,.1f} | {flops / ms / 1e6:,.0f} | {tps / peer:.2f}x |")
    if args.profile:
        print(
            f"\nOne plain decode step by kernel (ms, mean of {args.profile_steps} steps; load {os.getloadavg()[0]:.2f})"
        )
        print("| kernel | ms/step |")
        print("|---|---:|")
        for label, ms in profile_step(eng, prompt, args.profile_steps):
            print(f"| {label} | {ms:.3f} |")
        print(
            f"\nOne {len(long)}-token prefill by kernel, one worker (ms; load {os.getloadavg()[0]:.2f}; "
            f"the GEMMs' {flops / 1e9:.1f} GFLOP)"
        )
        print("| kernel | ms | share |")
        print("|---|---:|---:|")
        rows = profile_prefill(be, long)
        for label, ms in rows:
            print(f"| {label} | {ms:.1f} | {ms / rows[-1][1]:.0%} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="small,gpu", help="model presets, comma-separated (random weights)")
    ap.add_argument("--ckpt", help="a model file instead of random weights (with one preset's name ignored)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64, help="decode tokens (capped by the context)")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="prefill prompt (capped by the context)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=cpu_mod.usable_cores(),
        help="threads of ours (prefill) and of torch (default: the usable cores)",
    )
    ap.add_argument("--profile", action="store_true", help="also time one decode step and one prefill kernel by kernel")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench executable (default: $LLAMA_BENCH)")
    ap.add_argument(
        "--gguf",
        action="append",
        default=[],
        metavar="PRESET=FILE",
        help="the preset's weights as GGUF for llama-bench (repeatable)",
    )
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from nanoeuler import checkpoint

    print(
        f"CPU: {os.cpu_count()} cores visible, {cpu_mod.usable_cores()} usable; NumPy {np.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    if args.ckpt:
        params, cfg, meta = checkpoint.load_model(args.ckpt)
        ids = None
        if meta.get("tokenizer"):
            from nanoeuler.tokenizer.bpe import Tokenizer

            ids = Tokenizer.from_json(meta["tokenizer"]).encode(
                "The Python standard library is very extensive, offering a wide range of facilities."
            )
        bench_model(Path(args.ckpt).stem, params, cfg, args, ids)
        return 0
    for name in args.presets.split(","):
        cfg = ModelConfig.named(name)
        bench_model(name, transformer.init_params(cfg, seed=0), cfg, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
