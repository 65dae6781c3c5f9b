"""Tokens per second of one CPU training step, ours (NumPy) against PyTorch, on the same model and batch.

    python bench/train_cpu.py                    # the `small` model, batch 16 x 128, threads = cores
    python bench/train_cpu.py --threads 1 --batch 8 --steps 10

A step is what `nanoeuler pretrain` does per update: forward, backward, global-norm clipping to 1.0
and an AdamW update (weight decay 0.1 except norms and the embedding, betas 0.9/0.95). The PyTorch
peer is the identical architecture written here with idiomatic PyTorch (nn.Linear-free weight
tensors, F.scaled_dot_product_attention with GQA, F.cross_entropy, torch.optim.AdamW with foreach,
clip_grad_norm_), starting from the same weights; the script first checks that both give the same
loss. Both use the same number of threads (OpenBLAS for NumPy via OPENBLAS_NUM_THREADS, set before
NumPy is imported; torch.set_num_threads for PyTorch). Each side gets warm-up steps, then the two
alternate step by step and the median of each is reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    return p.parse_args()


ARGS = parse()
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread variables)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanoeuler.model import transformer  # noqa: E402
from nanoeuler.model.config import ModelConfig  # noqa: E402
from nanoeuler.optim import AdamW, clip_grad_norm  # noqa: E402

LR, WD, BETAS, EPS, CLIP = 1e-3, 0.1, (0.9, 0.95), 1e-8, 1.0


def no_decay(name: str, shape) -> bool:
    return len(shape) < 2 or name.endswith("norm.weight") or name.startswith("embed_tokens.")


def torch_loss(P: dict, ids, targets, cfg: ModelConfig, cos, sin):
    B, T = ids.shape
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    x = F.embedding(ids, P["embed_tokens.weight"])
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = rms(x, P[p + "input_layernorm.weight"])
        q = F.linear(h, P[p + "self_attn.q_proj.weight"]).view(B, T, H, D).transpose(1, 2)
        k = F.linear(h, P[p + "self_attn.k_proj.weight"]).view(B, T, Hkv, D).transpose(1, 2)
        v = F.linear(h, P[p + "self_attn.v_proj.weight"]).view(B, T, Hkv, D).transpose(1, 2)
        a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, H * D), P[p + "self_attn.o_proj.weight"])
        h = rms(x, P[p + "post_attention_layernorm.weight"])
        g = F.silu(F.linear(h, P[p + "mlp.gate_proj.weight"])) * F.linear(h, P[p + "mlp.up_proj.weight"])
        x = x + F.linear(g, P[p + "mlp.down_proj.weight"])
    xn = rms(x, P["norm.weight"]).reshape(B * T, cfg.dim)
    heads = ["lm_head.weight"] + [f"mtp_heads.{k}.weight" for k in range(1, cfg.mtp_heads)]
    losses = [
        F.cross_entropy(F.linear(xn, P[n]), targets[:, :, k].reshape(-1), ignore_index=-1) for k, n in enumerate(heads)
    ]
    return torch.stack(losses).mean()


def main() -> int:
    torch.set_num_threads(ARGS.threads)
    cfg = ModelConfig.named(ARGS.model)
    B, T, K = ARGS.batch, cfg.ctx_len, cfg.mtp_heads
    rng = np.random.default_rng(0)
    w = rng.integers(0, cfg.vocab_size, size=(B, T + K))
    inputs = np.ascontiguousarray(w[:, :T])
    targets = np.ascontiguousarray(np.stack([w[:, 1 + k : 1 + k + T] for k in range(K)], axis=-1))

    ours = transformer.init_params(cfg, seed=0)
    opt = AdamW(ours, betas=BETAS, eps=EPS, weight_decay=WD)
    P = {n: torch.tensor(p.copy(), requires_grad=True) for n, p in ours.items()}
    groups = [
        {"params": [P[n] for n in P if not no_decay(n, P[n].shape)], "weight_decay": WD},
        {"params": [P[n] for n in P if no_decay(n, P[n].shape)], "weight_decay": 0.0},
    ]
    topt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=True)
    t_ids, t_tg = torch.from_numpy(inputs), torch.from_numpy(targets)
    half = np.outer(np.arange(T), 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim // 2) * 2.0 / cfg.head_dim))
    ang = torch.from_numpy(np.concatenate([half, half], axis=-1))
    cos, sin = ang.cos().float(), ang.sin().float()

    def step_ours() -> float:
        loss, grads = transformer.loss_and_grads(ours, inputs, targets, cfg)
        clip_grad_norm(grads, CLIP)
        opt.step(ours, grads, LR)
        return loss

    def step_torch() -> float:
        topt.zero_grad(set_to_none=True)
        loss = torch_loss(P, t_ids, t_tg, cfg, cos, sin)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(P.values()), CLIP)
        topt.step()
        return loss.item()

    with torch.no_grad():
        l_ref = torch_loss(P, t_ids, t_tg, cfg, cos, sin).item()
    l_ours, _ = transformer.forward_loss(ours, inputs, targets, cfg)
    if abs(l_ours - l_ref) > 1e-4 * abs(l_ref):
        print(f"the two models disagree: loss {l_ours} (ours) vs {l_ref} (PyTorch)", file=sys.stderr)
        return 1

    for _ in range(ARGS.warmup):
        step_ours()
        step_torch()
    times = {"ours": [], "torch": []}
    losses = {"ours": [], "torch": []}
    for _ in range(ARGS.steps):
        for name, fn in (("ours", step_ours), ("torch", step_torch)):
            t0 = time.perf_counter()
            losses[name].append(fn())
            times[name].append(time.perf_counter() - t0)

    med = {k: float(np.median(v)) for k, v in times.items()}
    tps = {k: B * T / v for k, v in med.items()}
    cpu = _cpu_name()
    print(
        f"model {ARGS.model} ({cfg.n_params():,} params), batch {B} x {T} tokens, {ARGS.threads} threads, "
        f"{ARGS.warmup} warm-up + {ARGS.steps} timed steps each (alternating), median"
    )
    print(f"{cpu}; Python {platform.python_version()}, NumPy {np.__version__}, PyTorch {torch.__version__}")
    print(
        f"loss at the same weights: ours {l_ours:.6f}, PyTorch {l_ref:.6f}; "
        f"after training: ours {losses['ours'][-1]:.4f}, PyTorch {losses['torch'][-1]:.4f}"
    )
    print()
    print("| implementation | ms / step | tokens / s | vs PyTorch |")
    print("|---|---:|---:|---:|")
    for name, label in (("ours", "nanoeuler (NumPy)"), ("torch", "PyTorch (CPU, eager)")):
        print(f"| {label} | {med[name] * 1000:.1f} | {tps[name]:,.0f} | {tps[name] / tps['torch']:.2f}x |")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
