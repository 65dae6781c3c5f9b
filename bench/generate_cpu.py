"""Generation speed on the CPU: our NumPy decode engine against PyTorch eager with a KV cache, same model.

    python bench/generate_cpu.py --ckpt results/base.bin --threads 2      # the `small` model, trained
    python bench/generate_cpu.py                                          # random `small` weights

Batch 1, a 16-token prompt, greedy, as many new tokens as fit the context (112 for the `small` preset's 128),
so neither side slides its window. The PyTorch peer is the identical architecture written in torch (stacked
q/k/v and gate/up weights, RMSNorm, RoPE, grouped-query attention over a preallocated cache, SwiGLU, the
output head) run eagerly under inference_mode with torch.set_num_threads(threads); it must produce our
greedy tokens. Rows: ours plain, ours speculative (acceptance per draft head), torch eager. Medians of
--repeats runs after a warm-up; the load average is printed, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoeuler.infer.engine import Engine  # noqa: E402
from nanoeuler.infer.generate import Sampling  # noqa: E402
from nanoeuler.model import transformer  # noqa: E402
from nanoeuler.model.config import ModelConfig  # noqa: E402
from nanoeuler.model.layers import rope_tables  # noqa: E402

GREEDY = Sampling(temperature=0.0)


def median_time(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def torch_decoder(params, cfg):
    """greedy(prompt, n) -> ids: the model in torch, eager, with a preallocated KV cache."""
    import torch

    T = lambda a: torch.tensor(np.asarray(a, dtype=np.float32))  # noqa: E731
    H, Hkv, D, F, L = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden, cfg.ctx_len
    G = H // Hkv
    lay = []
    for i in range(cfg.n_layers):
        g = lambda n: params[f"layers.{i}.{n}"]  # noqa: E731
        lay.append((T(g("input_layernorm.weight")),
                    T(np.concatenate([g(f"self_attn.{w}_proj.weight") for w in "qkv"])),
                    T(g("self_attn.o_proj.weight")), T(g("post_attention_layernorm.weight")),
                    T(np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])),
                    T(g("mlp.down_proj.weight"))))
    emb, norm, head = T(params["embed_tokens.weight"]), T(params["norm.weight"]), T(params["lm_head.weight"])
    cos, sin = (T(a) for a in rope_tables(L, D, cfg.rope_theta, np, np.float32))
    kc = torch.zeros(cfg.n_layers, Hkv, L, D)
    vc = torch.zeros(cfg.n_layers, Hkv, L, D)
    eps = cfg.norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, c, s):  # x (t, heads, D)
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def forward(ids, start):
        t = ids.shape[0]
        x = emb[ids]
        c, s = cos[start:start + t, None], sin[start:start + t, None]
        mask = torch.ones(t, start + t, dtype=torch.bool).tril(start)
        for li, (n1, wqkv, wo, n2, wgu, wd) in enumerate(lay):
            qkv = rms(x, n1) @ wqkv.T
            q = rope(qkv[:, :H * D].view(t, H, D), c, s)
            kc[li, :, start:start + t] = rope(qkv[:, H * D:(H + Hkv) * D].view(t, Hkv, D), c, s).transpose(0, 1)
            vc[li, :, start:start + t] = qkv[:, (H + Hkv) * D:].view(t, Hkv, D).transpose(0, 1)
            k, v = kc[li, :, :start + t], vc[li, :, :start + t]  # (Hkv, S, D)
            qg = q.transpose(0, 1).reshape(Hkv, G * t, D) / D ** 0.5
            sc = (qg @ k.transpose(1, 2)).view(Hkv, G, t, start + t).masked_fill(~mask, float("-inf"))
            a = (sc.softmax(-1).view(Hkv, G * t, start + t) @ v).view(H, t, D).transpose(0, 1).reshape(t, H * D)
            x = x + a @ wo.T
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

    return greedy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="model file (default: random weights of the `small` preset)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=0, help="0: as many as fit the context")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (NumPy's BLAS: set OMP_NUM_THREADS)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from nanoeuler import checkpoint

    if args.ckpt:
        params, cfg, meta = checkpoint.load_model(args.ckpt)
    else:
        cfg = ModelConfig.named("small")
        params = transformer.init_params(cfg, seed=0)
    n = args.new_tokens or cfg.ctx_len - args.prompt_len
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len)]
    if args.ckpt and meta.get("tokenizer"):
        from nanoeuler.tokenizer.bpe import Tokenizer

        ids = Tokenizer.from_json(meta["tokenizer"]).encode(
            "The Python standard library is very extensive, offering a wide range of facilities.")
        prompt = (ids * 4)[:args.prompt_len]

    eng = Engine.from_params(params, cfg, "cpu")
    greedy_t = torch_decoder(params, cfg)
    ours = list(eng.stream(prompt, n, GREEDY, speculative=False))
    theirs = greedy_t(prompt, n)
    rows = []
    load0 = os.getloadavg()[0]
    t = median_time(lambda: list(eng.stream(prompt, n, GREEDY, speculative=False)), args.repeats)
    rows.append(("ours plain (NumPy float32)", n / t, ""))
    eng.stats = type(eng.stats)()
    t = median_time(lambda: list(eng.stream(prompt, n, GREEDY, speculative=True)), args.repeats)
    st = eng.stats
    rows.append(("ours speculative (NumPy float32)", n / t,
                 f"{st.tokens_per_pass():.2f} tok/pass; heads " + " ".join(f"{a:.2f}" for a in st.acceptance())))
    t = median_time(lambda: greedy_t(prompt, n), args.repeats)
    rows.append((f"PyTorch {torch.__version__} eager, KV cache", n / t, f"{args.threads} threads"))
    load1 = os.getloadavg()[0]

    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    print(f"\nCPU ({os.cpu_count()} cores visible), model {cfg.n_params():,} parameters "
          f"({'trained: ' + args.ckpt if args.ckpt else 'random'}), batch 1, {args.prompt_len}-token prompt, "
          f"{n} new tokens greedy, median of {args.repeats}; load average {load0:.2f} -> {load1:.2f}")
    print("| run | tokens/s | ms/token | vs PyTorch | notes |")
    print("|---|---:|---:|---:|---|")
    peer = rows[-1][1]
    for name, tps, note in rows:
        print(f"| {name} | {tps:,.0f} | {1e3 / tps:.3f} | {tps / peer:.2f}x | {note} |")
    print("greedy tokens, ours vs PyTorch: " + ("identical" if first_diff is None else f"first differ at {first_diff}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
