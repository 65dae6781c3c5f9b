"""Generation speed on the GPU: our decode engine against Hugging Face transformers on the same weights.

    python bench/generate_gpu.py --ckpt results/base.bin          # a trained model (acceptance means something)
    python bench/generate_gpu.py                                  # random `gpu`-preset weights (speed only)

One run, batch 1, a 16-token prompt and 256 new tokens (greedy), on the same weights: ours plain (bf16),
ours self-speculative (bf16, the MTP heads drafting), HF `generate` eager (bf16), HF with a static cache and
torch.compile (where it works; the error is printed where not). Columns: tokens/s, ms/token, the prefill of
a 512-token prompt in ms, and the speculative acceptance. Then batch 64 (64 different 16-token prompts)
against batch 1, and the agreement of our greedy tokens with the reference `Generator` (float32 CuPy layers):
float32 engine (identical expected) and bf16 engine (identical until the first near-tie).
Times are medians over --repeats runs after a warm-up run. Acceptance depends on the text, so speculation is
also measured over --spec-prompts prompts (each decoded once, plainly and speculatively).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoeuler.infer.engine import DecodeEngine  # noqa: E402
from nanoeuler.infer.generate import Generator  # noqa: E402
from nanoeuler.infer.sampling import Sampling  # noqa: E402
from nanoeuler.model import transformer  # noqa: E402
from nanoeuler.model.config import ModelConfig  # noqa: E402

GREEDY = Sampling(temperature=0.0)


def timed(fn, repeats):
    import cupy as cp

    fn()  # warm-up: compiles kernels, records graphs
    cp.cuda.Device().synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def prompts_from(tok, cfg, n, length, rng, text=None):
    """n prompts of `length` tokens: windows of a text when a tokenizer is given (`text`: n windows spread
    evenly over it, else a repeated sentence every 7 tokens), else random ids."""
    if tok is None:
        return [list(rng.integers(0, cfg.vocab_size, length)) for _ in range(n)]
    if text is not None:
        ids = tok.encode(text)
        if len(ids) < n * length:
            raise SystemExit(f"--prompt-text: {len(ids)} tokens, fewer than {n} prompts of {length}")
        stride = (len(ids) - length) // max(n - 1, 1)
        return [ids[i * stride : i * stride + length] for i in range(n)]
    text = (
        "The Python standard library is very extensive, offering a wide range of facilities. "
        "It contains built-in modules that provide access to system functionality such as file I/O. "
    ) * 40
    ids = tok.encode(text)
    return [ids[i * 7 : i * 7 + length] for i in range(n)]


def read_text(path: str, limit: int = 2_000_000) -> str:
    """The first `limit` characters of a UTF-8 text file, or of a corpus parquet's `text` column (the
    tokenizer stage's reader); a file that cannot be read stops the run with one line naming it."""
    from nanoeuler.errors import UserError
    from nanoeuler.tokenizer.shards import iter_batches, open_corpus

    try:
        if not path.endswith(".parquet"):
            return Path(path).read_text(encoding="utf-8")[:limit]
        parts, size = [], 0
        for batch in iter_batches(open_corpus(Path(path)), Path(path)):
            parts += batch
            size += sum(map(len, batch))
            if size >= limit:
                break
        return "\n\n".join(parts)[:limit]
    except (UserError, OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"--prompt-text: {path}: {exc}") from None


def ours(params, cfg, prompt, args, rows):
    eng = DecodeEngine.from_params(params, cfg, "gpu", dtype="bf16")
    n = args.new_tokens
    for name, spec in (("ours plain (bf16)", False), ("ours speculative (bf16)", True)):
        eng.stats = type(eng.stats)()
        sec = timed(lambda: list(eng.stream(prompt, n, GREEDY, speculative=spec)), args.repeats)
        acc = ""
        if spec:
            st = eng.stats
            acc = f"{st.tokens_per_pass():.2f} tok/pass; heads " + " ".join(f"{a:.2f}" for a in st.acceptance())
        rows.append((name, n / sec, 1e3 * sec / n, None, acc))
    be = eng.backend
    mode = "on" if be.pdl else "off"
    args.graph_us = {f"{k} (PDL {mode})": v for k, v in graph_times(be, cfg, prompt, args.repeats).items()}
    if be.pdl is not None:  # the same steps launched the ordinary way, on a second copy of the weights
        from nanoeuler.infer.gpu import GpuBackend

        plain = GpuBackend(params, cfg, dtype="bf16", pdl=False)
        args.graph_us.update({f"{k} (PDL off)": v for k, v in graph_times(plain, cfg, prompt, args.repeats).items()})
        del plain
    args.floor_us = launch_floor(100, args.repeats)
    long_prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 512)]
    be.start(1, [0])
    be.prefill(0, long_prompt)  # kernel by kernel; `timed`'s warm-up then records the graph
    pre = timed(lambda: be.prefill(0, long_prompt), args.repeats)
    rows[-2] = rows[-2][:3] + (1e3 * pre,) + rows[-2][4:]
    return eng


def kernel_profile(be, cfg, prompt, M, n_heads, reps=20):
    """GPU time of each kernel of one forward step over M rows, run kernel by kernel with CUDA events around
    every launch: {label: (launches per step, microseconds per step)}. Upper bounds: each includes the
    host's launch gap (the GPU waits for Python here)."""
    import cupy as cp

    events = []
    launch = be.go.launch

    def timed_launch(name, grid, block, args, **kw):
        label = f"{name} N={int(args[6])}" if name.startswith("gemv") and "rope" not in name else name
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(be.stream)
        launch(name, grid, block, args, **kw)
        end.record(be.stream)
        events.append((label, start, end))

    be.go.launch = timed_launch  # the launchers of kernels/decode/ all go through it
    try:
        be.start(1, [0])
        be.prefill(0, prompt)
        r = be._buffers(M)
        r.ctl_host[: 3 * M] = np.concatenate([np.full(M, prompt[-1]), np.zeros(M), len(prompt) + np.arange(M)])
        with be.stream:
            r.ctl.data.copy_from_host_async(r.ctl_host.ctypes.data, r.ctl_host.nbytes, be.stream)
        events.clear()
        with be.stream:
            for _ in range(reps):
                be._step(r, M, n_heads, "argmax")
        be.stream.synchronize()
    finally:
        del be.go.launch
    total: dict = {}
    for label, s, e in events:
        n, us = total.get(label, (0, 0.0))
        total[label] = (n + 1, us + 1e3 * cp.cuda.get_elapsed_time(s, e))
    return {k: (n // reps, us / reps) for k, (n, us) in total.items()}


def graph_times(be, cfg, prompt, repeats):
    """Microseconds of the decode step's graph (batch 1) and of a verify pass's (K rows, all heads),
    replayed 100 times back to back with no host work, at the prompt's end of the cache."""
    out = {}
    be.start(1, [0])
    be.prefill(0, prompt)
    for label, M, nh in (("decode step", 1, 1), ("verify pass", cfg.mtp_heads, cfg.mtp_heads)):
        meta = np.concatenate([np.full(M, prompt[-1]), np.zeros(M), len(prompt) + np.arange(M)]).astype(np.int32)
        for _ in range(3):  # eager, capture, replay
            be._run(M, nh, "argmax", meta)
        be.stream.synchronize()
        g = be._graphs[(M, nh, "argmax")]
        out[label] = 1e6 * timed(lambda: [g.launch(be.stream) for _ in range(100)], repeats) / 100
    return out


def launch_floor(n_kernels, repeats):
    """Microseconds per kernel of a graph of `n_kernels` empty one-block kernels: the cost of a kernel
    boundary in a replayed graph, whatever the kernel does."""
    import cupy as cp

    nop = cp.RawKernel(r'extern "C" __global__ void nop() {}', "nop")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        nop((1,), (32,), ())
        s.synchronize()
        s.begin_capture()
        for _ in range(n_kernels):
            nop((1,), (32,), ())
        g = s.end_capture()
    return 1e6 * timed(lambda: [g.launch(s) for _ in range(20)], repeats) / 20 / n_kernels


def hf_rows(ckpt, cfg, prompt, args, rows):
    try:
        import torch
        from transformers import LlamaForCausalLM

        from nanoeuler.export.hf import export
    except Exception as exc:  # noqa: BLE001
        rows.append(("HF (not run)", None, None, None, f"{type(exc).__name__}: {exc}"[:80]))
        return
    out = Path(tempfile.mkdtemp()) / "hf"
    export(ckpt, out)
    model = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    n = args.new_tokens

    def gen(m, **kw):
        with torch.no_grad():
            m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)

    def cuda_timed(fn):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    long_ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda")
    with torch.no_grad():
        pre = cuda_timed(lambda: model(long_ids))
    sec = cuda_timed(lambda: gen(model))
    rows.append(("HF generate eager (bf16)", n / sec, 1e3 * sec / n, 1e3 * pre, ""))
    if args.no_hf_compile:
        rows.append(("HF static cache + torch.compile", None, None, None, "not run (--no-hf-compile)"))
        return
    try:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        t0 = time.perf_counter()
        gen(model)
        compile_s = time.perf_counter() - t0
        sec = cuda_timed(lambda: gen(model))
        rows.append(
            ("HF static cache + torch.compile", n / sec, 1e3 * sec / n, None, f"compile {compile_s:.0f} s (not timed)")
        )
    except Exception as exc:  # noqa: BLE001
        rows.append(
            (
                "HF static cache + torch.compile",
                None,
                None,
                None,
                f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}",
            )
        )


def batched(eng, cfg, prompts, args):
    n = args.new_tokens
    one = timed(lambda: eng.generate(prompts[:1], n, GREEDY, speculative=False), args.repeats)
    many = timed(lambda: eng.generate(prompts, n, GREEDY), args.repeats)
    return n / one, len(prompts) * n / many


def speculation_over(eng, prompts, n):
    """Plain and speculative greedy decoding of each prompt once (after a warm-up): total tokens/s of each,
    the speculative passes' tokens per pass and per-head acceptance over all of them, and each prompt's
    speculative/plain ratio."""
    import cupy as cp

    def one(p, spec):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        list(eng.stream(p, n, GREEDY, speculative=spec))
        cp.cuda.Device().synchronize()
        return time.perf_counter() - t0

    for spec in (False, True):
        one(prompts[0], spec)
    eng.stats = type(eng.stats)()
    secs = np.array([[one(p, spec) for spec in (False, True)] for p in prompts])
    plain, spec = len(prompts) * n / secs.sum(axis=0)
    st = eng.stats
    return plain, spec, st.tokens_per_pass(), st.acceptance(), secs[:, 0] / secs[:, 1]


def agreement(params, cfg, prompt, steps):
    """First index where our greedy tokens leave the reference Generator's (float32 CuPy layers); None = never."""
    import cupy as cp

    ref = Generator({k: cp.asarray(v, dtype=cp.float32) for k, v in params.items()}, cfg)
    want = ref.generate(prompt, steps, GREEDY)
    out = {}
    for dtype in ("fp32", "bf16"):
        got = DecodeEngine.from_params(params, cfg, "gpu", dtype=dtype).generate(
            [prompt], steps, GREEDY, speculative=False
        )[0]
        out[dtype] = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="model file (default: random weights of the `gpu` preset)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--agree-steps", type=int, default=64)
    ap.add_argument(
        "--spec-prompts",
        type=int,
        default=8,
        help="also decode this many of the prompts plainly and speculatively (acceptance over them)",
    )
    ap.add_argument(
        "--prompt-text",
        metavar="FILE",
        help="draw the prompts from this text (a UTF-8 file, or a parquet's `text` column, e.g. the "
        "corpus's val.parquet), windows spread over it; default: a repeated sentence",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    ap.add_argument("--no-hf-compile", action="store_true", help="skip the torch.compile row (it takes minutes)")
    ap.add_argument("--profile", action="store_true", help="also time each kernel of a decode step and a verify pass")
    ap.add_argument(
        "--steps-only",
        type=int,
        default=0,
        metavar="N",
        help="only prefill the prompt and run N greedy decode steps (a target for a profiler), then exit",
    )
    ap.add_argument("--steps-batch", type=int, default=1, metavar="B", help="rows of the --steps-only steps")
    args = ap.parse_args(argv)

    from nanoeuler import checkpoint

    tok = None
    ckpt = args.ckpt
    if ckpt:
        params, cfg, meta = checkpoint.load_model(ckpt)
        if meta.get("tokenizer"):
            from nanoeuler.tokenizer.bpe import Tokenizer

            tok = Tokenizer.from_json(meta["tokenizer"])
    else:
        cfg = ModelConfig.named("gpu")
        params = transformer.init_params(cfg, seed=0)
        ckpt = str(Path(tempfile.mkdtemp()) / "random.bin")
        checkpoint.save_model(ckpt, params, cfg, step=0, tokenizer_json=None)
    rng = np.random.default_rng(0)
    text = read_text(args.prompt_text) if args.prompt_text else None
    if text is not None and tok is None:
        raise SystemExit(f"--prompt-text: {args.ckpt or 'random weights'} has no tokenizer to encode it")
    prompts = prompts_from(tok, cfg, args.batch, args.prompt_len, rng, text)
    prompt = prompts[0]
    if args.steps_only:
        eng = DecodeEngine.from_params(params, cfg, "gpu", dtype="bf16")
        eng.generate(prompts[: args.steps_batch], args.steps_only, GREEDY, speculative=False)
        return 0
    rows: list = []
    eng = ours(params, cfg, prompt, args, rows)
    one, many = batched(eng, cfg, prompts, args)
    spread = speculation_over(eng, prompts[: args.spec_prompts], args.new_tokens) if args.spec_prompts else None
    profiles = {}
    if args.profile:
        for label, M, nh in (("decode step", 1, 1), ("verify pass", cfg.mtp_heads, cfg.mtp_heads)):
            profiles[label] = kernel_profile(eng.backend, cfg, prompt, M, nh)
    agree = agreement(params, cfg, prompt, args.agree_steps)
    if not args.no_hf:
        hf_rows(ckpt, cfg, prompt, args, rows)

    import cupy as cp

    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(
        f"\n{dev}, model {cfg.n_params():,} parameters ({'trained: ' + args.ckpt if args.ckpt else 'random'}), "
        f"batch 1, {args.prompt_len}-token prompt, {args.new_tokens} new tokens greedy, median of {args.repeats}"
    )
    base = rows[0][1]
    print(f"| {'run':34s} | tokens/s | ms/token | vs ours plain | prefill 512 (ms) | notes |")
    print("|---|---:|---:|---:|---:|---|")
    for name, tps, ms, pre, note in rows:
        f = lambda v, fmt: format(v, fmt) if v is not None else "–"  # noqa: E731
        ratio = f"{tps / base:.2f}x" if tps else "–"
        print(f"| {name:34s} | {f(tps, ',.0f')} | {f(ms, '.3f')} | {ratio} | {f(pre, '.2f')} | {note} |")
    for label, us in args.graph_us.items():
        print(f"{label} graph replayed alone (GPU time, no host work): {us:.1f} us")
    print(f"a graph of 100 empty kernels: {args.floor_us:.2f} us per kernel")
    print(
        f"\nbatched greedy, ours bf16: batch 1 {one:,.0f} tokens/s, batch {args.batch} {many:,.0f} tokens/s "
        f"= {many / one:.1f}x"
    )
    if spread:
        plain, spec, tpp, acc, ratios = spread
        print(
            f"greedy over {args.spec_prompts} prompts (windows of the text, one after the other): plain "
            f"{plain:,.0f} tokens/s, speculative {spec:,.0f} = {spec / plain:.2f}x; {tpp:.2f} tokens/pass, heads "
            + " ".join(f"{a:.2f}" for a in acc)
        )
        q = np.percentile(ratios, [0, 25, 50, 75, 100])
        print(
            f"  per prompt, speculative / plain: min {q[0]:.2f}x, quartiles {q[1]:.2f}x {q[2]:.2f}x {q[3]:.2f}x, "
            f"max {q[4]:.2f}x; {int((ratios >= 1.6).sum())} of {len(ratios)} prompts at 1.6x or more"
        )
    for label, prof in profiles.items():
        print(f"\n{label}, kernel by kernel (CUDA events around each launch, mean of 20 steps):")
        print("| kernel | launches | us per step | share |")
        print("|---|---:|---:|---:|")
        whole = sum(us for _, us in prof.values())
        for k, (n, us) in sorted(prof.items(), key=lambda kv: -kv[1][1]):
            print(f"| {k} | {n} | {us:.1f} | {us / whole:.0%} |")
        print(f"| all | {sum(n for n, _ in prof.values())} | {whole:.1f} | |")
    for dtype, i in agree.items():
        where = f"identical for all {args.agree_steps} tokens" if i is None else f"first differs at token {i}"
        print(f"greedy vs reference Generator (float32 layers), ours {dtype}: {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
