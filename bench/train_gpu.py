"""Training-step speed on one GPU: our engines against PyTorch running the identical architecture.

    python bench/train_gpu.py                       # rows B16xT512, B16xT1024, B64xT512
    python bench/train_gpu.py --rows 16x512 --modes torch-eager,ours-bf16
    python bench/train_gpu.py --agree 300           # bf16 vs fp32 training on fixed data (loss agreement)

Modes (all in one process, on the same device, one after another, each on fresh random tokens):
  torch-eager    PyTorch, bf16 autocast, eager
  torch-compile  the same module under torch.compile (compile time reported, not timed)
  ours-fp32      nanoeuler's float32 GPU path: transformer.loss_and_grads + clip_grad_norm + fused AdamW kernel
  ours-bf16      nanoeuler.kernels.bf16.engine: bf16 GEMMs (fp32 accumulate), fp32 master weights and AdamW state

The PyTorch model is ours written in torch: token embedding; pre-norm blocks of RMSNorm (computed in fp32),
q/k/v from one stacked projection, half-split RoPE, causal GQA through scaled_dot_product_attention with
enable_gqa (K/V never repeated), o_proj; RMSNorm, SwiGLU (gate/up stacked), down_proj; final RMSNorm;
K untied heads, loss = mean over heads of each head's mean cross-entropy. Fused AdamW (betas 0.9/0.95,
eps 1e-8, weight decay 0.1 on matrices except the embedding), global-norm clipping at 1.0.

A step is forward + backward + clipping + optimizer update. Each mode runs --warmup steps, then --steps
timed steps, each between two CUDA events; the median is reported.

FLOPs per token (stated so the MFU is reproducible):
  6 * N_mm + 6 * L * T * C
where N_mm is the number of parameters used in matrix products (all but the embedding table and the norm
gains; the four output heads count) and 6*L*T*C is causal attention (QK^T and PV, 2*T*C per token and
layer forward with the causal half, times 3 for forward+backward). MFU = FLOP/s / 989e12 (H100 SXM dense
bf16 peak), also for float32 runs, so the columns compare.

Clocks: while each mode's timed steps run, the SM clock, the power draw and whether the power cap is
throttling are read every 100 ms (NVML; columns MHz, W, capped: medians, and the share of samples
throttled). An H100/H200 under a sustained load holds its power limit by lowering the SM clock, so a
step's time depends on the chip's power behaviour as well as on the code; the columns show when it did.
The power is a one-second average: 20 short steps (B16xT512: 0.3 s) end before it settles; --steps 100 do not.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PEAK_BF16 = 989e12
ALL_MODES = ("torch-eager", "torch-compile", "ours-fp32", "ours-bf16")
# also available: ours-bf16-<flag>[-<flag>...], the engine's options named by flags (see engine_options)


def flops_per_token(cfg, T):
    n_mm = cfg.n_params() - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    return 6 * n_mm + 6 * cfg.n_layers * T * cfg.dim


class PowerSampler:
    """SM clock, power draw and power-cap throttling of one GPU, read through NVML (the driver's management
    library) every `period_ms` by a thread while the sampler is open; `span()` marks a span of host time,
    `summary(span)` sums up the samples within it.

        >>> with PowerSampler("00000000:19:00.0") as power:                    # doctest: +SKIP
        ...     with power.span() as w:
        ...         run_timed_steps()
        >>> power.summary(w)                                                  # doctest: +SKIP
        {'mhz': 1650.0, 'watts': 693.4, 'capped': 0.9, 'samples': 31}

    The power is NVML's power usage, an average over about the last second: read it over spans of
    seconds. Without the library (no NVIDIA driver) every summary is None."""

    SM_CLOCK = 1  # NVML_CLOCK_SM
    SW_POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap

    def __init__(self, pci_bus_id: str, period_ms: int = 100, library: str = "libnvidia-ml.so.1"):
        self.bus, self.period, self.library = pci_bus_id, period_ms / 1e3, library
        self.samples: list = []  # (epoch seconds, MHz, W, capped)
        self._thread = None

    def __enter__(self):
        import ctypes
        import threading

        try:
            nvml = ctypes.CDLL(self.library)
        except OSError:
            return self
        handle = ctypes.c_void_p()
        if nvml.nvmlInit_v2() != 0:
            return self
        if nvml.nvmlDeviceGetHandleByPciBusId_v2(self.bus.encode(), ctypes.byref(handle)) != 0:
            nvml.nvmlShutdown()
            return self
        self._nvml, self._stop = nvml, threading.Event()

        def sample():
            clock, mw, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
            while not self._stop.is_set():
                t = time.time()
                if (
                    nvml.nvmlDeviceGetClockInfo(handle, self.SM_CLOCK, ctypes.byref(clock)) == 0
                    and nvml.nvmlDeviceGetPowerUsage(handle, ctypes.byref(mw)) == 0
                    and nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle, ctypes.byref(reasons)) == 0
                ):
                    capped = bool(reasons.value & self.SW_POWER_CAP)
                    self.samples.append((t, float(clock.value), mw.value / 1e3, capped))
                self._stop.wait(self.period)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvml.nvmlShutdown()
            self._thread = None
        return False

    class Span:
        """A span of host time (epoch seconds), set by `with`."""

        def __init__(self):
            self.t0 = self.t1 = None

        def __enter__(self):
            self.t0 = time.time()
            return self

        def __exit__(self, *exc):
            self.t1 = time.time()
            return False

    def span(self) -> PowerSampler.Span:
        return self.Span()

    def summary(self, w: PowerSampler.Span):
        """Median MHz and W and the share of throttled samples within the span; None without a sample.

        >>> p = PowerSampler("0")
        >>> p.samples = [(1.0, 1980.0, 120.0, False), (2.0, 1650.0, 693.4, True), (3.0, 1515.0, 696.7, True)]
        >>> w = p.span(); w.t0, w.t1 = 1.5, 3.5
        >>> p.summary(w)
        {'mhz': 1582.5, 'watts': 695.05, 'capped': 1.0, 'samples': 2}
        """
        inside = [s for s in self.samples if w.t1 is not None and w.t0 <= s[0] <= w.t1]
        if not inside:
            return None
        return {
            "mhz": statistics.median(s[1] for s in inside),
            "watts": round(statistics.median(s[2] for s in inside), 2),
            "capped": round(sum(s[3] for s in inside) / len(inside), 2),
            "samples": len(inside),
        }


# ---- PyTorch model ---------------------------------------------------------------------------------


def torch_model(cfg, params_np, device):
    import torch
    import torch.nn.functional as F
    from torch import nn

    H, Hkv, D, Fh, V, K = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden, cfg.vocab_size, cfg.mtp_heads

    def P(name):
        return nn.Parameter(torch.tensor(np.asarray(params_np[name]), dtype=torch.float32, device=device))

    def rms(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)) * w

    half = D // 2
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / D))

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            p = f"layers.{i}."
            self.n1 = P(p + "input_layernorm.weight")
            self.wqkv = nn.Parameter(
                torch.cat(
                    [
                        P(p + "self_attn.q_proj.weight").data,
                        P(p + "self_attn.k_proj.weight").data,
                        P(p + "self_attn.v_proj.weight").data,
                    ]
                )
            )
            self.wo = P(p + "self_attn.o_proj.weight")
            self.n2 = P(p + "post_attention_layernorm.weight")
            self.wgu = nn.Parameter(torch.cat([P(p + "mlp.gate_proj.weight").data, P(p + "mlp.up_proj.weight").data]))
            self.wd = P(p + "mlp.down_proj.weight")

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = rms(x, self.n1)
            qkv = F.linear(h, self.wqkv)
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = q.view(B, T, H, D).transpose(1, 2)
            k = k.view(B, T, Hkv, D).transpose(1, 2)
            v = v.view(B, T, Hkv, D).transpose(1, 2)

            def rope(t):
                t1, t2 = t[..., :half], t[..., half:]
                return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(v.dtype)

            a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, H * D), self.wo)
            h2 = rms(x, self.n2)
            g, u = F.linear(h2, self.wgu).split([Fh, Fh], dim=-1)
            return x + F.linear(F.silu(g) * u, self.wd)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = P("embed_tokens.weight")
            self.blocks = nn.ModuleList([Block(i) for i in range(cfg.n_layers)])
            self.norm = P("norm.weight")
            names = ["lm_head.weight"] + [f"mtp_heads.{k}.weight" for k in range(1, K)]
            self.heads = nn.ParameterList([P(n) for n in names])

        def forward(self, ids, targets):
            B, T = ids.shape
            pos = torch.arange(T, device=ids.device, dtype=torch.float64)
            ang = torch.outer(pos, torch.tensor(inv, device=ids.device))
            cos, sin = ang.cos().float(), ang.sin().float()
            x = F.embedding(ids, self.emb)
            for blk in self.blocks:
                x = blk(x, cos, sin)
            xn = rms(x, self.norm)
            loss = 0.0
            for k, w in enumerate(self.heads):
                logits = F.linear(xn, w)
                loss = loss + F.cross_entropy(logits.float().view(-1, V), targets[:, :, k].reshape(-1), ignore_index=-1)
            return loss / K

    return Model().to(device)


def torch_run(cfg, params_np, B, T, steps, warmup, compiled, log, timed):
    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch_model(cfg, params_np, dev)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "emb"]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and n != "emb")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    fwd = torch.compile(model) if compiled else model
    g = torch.Generator(device="cpu").manual_seed(1)

    def batch():
        w = torch.randint(0, cfg.vocab_size, (B, T + cfg.mtp_heads), generator=g)
        tg = torch.stack([w[:, 1 + k : T + 1 + k] for k in range(cfg.mtp_heads)], dim=-1)
        return w[:, :T].to(dev, non_blocking=True), tg.to(dev, non_blocking=True)

    batches = [batch() for _ in range(4)]

    def step(i):
        ids, tg = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(ids, tg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = []
    loss = None
    with timed:  # the timed steps' span of time (PowerSampler)
        for i in range(steps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            loss = step(i)
            e1.record()
            times.append((e0, e1))
        torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in times]
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    log(
        f"  warm-up {warm_s:.1f} s (compile included), last loss {float(loss):.4f}, reserved {reserved / 2**30:.2f} GiB"
    )
    return statistics.median(ms), peak, float(loss)


# ---- ours ------------------------------------------------------------------------------------------


def _windows(cfg, B, T, seed, count=4):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        w = rng.integers(0, cfg.vocab_size, size=(B, T + cfg.mtp_heads))
        out.append((w[:, :T], np.stack([w[:, 1 + k : T + 1 + k] for k in range(cfg.mtp_heads)], axis=-1)))
    return out


def ours_fp32_run(cfg, params_np, B, T, steps, warmup, log, timed):
    import cupy

    from nanoeuler.model import transformer
    from nanoeuler.optim import AdamW, clip_grad_norm

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    params = {n: cupy.asarray(p) for n, p in params_np.items()}
    opt = AdamW(params, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    data = [(cupy.asarray(i), cupy.asarray(t)) for i, t in _windows(cfg, B, T, 2)]

    def step(s):
        ids, tg = data[s % len(data)]
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        loss, grads = transformer.loss_and_grads(params, ids, tg, cfg)
        clip_grad_norm(grads, 1.0)
        opt.step(params, grads, 3e-4)
        del grads
        e1.record()
        e1.synchronize()
        return loss, cupy.cuda.get_elapsed_time(e0, e1)

    for s in range(warmup):
        step(s)
    with timed:
        loss, ms = None, []
        for s in range(warmup, warmup + steps):
            loss, t = step(s)
            ms.append(t)
    peak = pool.total_bytes()
    log(f"  last loss {loss:.4f}; note: loss_and_grads reads the loss on the host every step")
    return statistics.median(ms), peak, float(loss)


def engine_options(mode: str) -> dict:
    """`TrainEngine` keyword arguments of a mode `ours-bf16[-flag...]`, each flag an attention variant (wg, ldm,
    mma; fa32 for the float32 FlashAttention), `eager` (no CUDA graph), `norope` (RoPE and the attention
    layouts after the qkv GEMM, not inside it), `nofuse` (that, and the SwiGLU forward and backward
    after their GEMMs too) or `muon` (Muon on the hidden matrices instead of AdamW).

        >>> engine_options("ours-bf16-ldm-eager"), engine_options("ours-bf16-fa32"), engine_options("ours-bf16")
        ({'attention': 'ldm', 'graph': False}, {'attention': 'fp32'}, {})
    """
    opts: dict = {}
    for flag in mode.split("-")[2:]:
        if flag in ("wg", "ldm", "mma", "fa32"):
            opts["attention"] = "fp32" if flag == "fa32" else flag
        elif flag == "eager":
            opts["graph"] = False
        elif flag == "norope":
            opts["fuse_rope"] = False
        elif flag == "nofuse":
            opts["fuse_swiglu"] = opts["fuse_rope"] = False
        elif flag == "muon":
            opts["optimizer"] = "muon"
        else:
            raise ValueError(f"unknown flag {flag!r} in mode {mode!r}")
    return opts


def ours_bf16_run(cfg, params_np, B, T, steps, warmup, log, timed, **options):
    import cupy

    from nanoeuler.kernels.bf16.engine import TrainEngine

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    eng = TrainEngine(cfg, params_np, batch=B, seq=T, lr=3e-4, **options)
    data = [(cupy.asarray(i, dtype=np.int32), cupy.asarray(t, dtype=np.int32)) for i, t in _windows(cfg, B, T, 2)]

    def step(s):
        ids, tg = data[s % len(data)]
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        eng.step(ids, tg, lr=3e-4)
        e1.record()
        return e0, e1

    for s in range(warmup):
        step(s)[1].synchronize()
    with timed:
        events = [step(s) for s in range(warmup, warmup + steps)]
        cupy.cuda.Stream.null.synchronize()
    ms = [cupy.cuda.get_elapsed_time(a, b) for a, b in events]
    loss = float(eng.last_loss())
    peak = pool.total_bytes()
    log(
        f"  last loss {loss:.4f}, engine buffers {eng.nbytes() / 2**30:.2f} GiB, "
        f"pool used {pool.used_bytes() / 2**30:.2f} / total {pool.total_bytes() / 2**30:.2f} GiB"
    )
    return statistics.median(ms), peak, loss


def profile_engine(cfg, params_np, B, T, log, **options):
    """Kernel time of two engine steps by kernel name (CUPTI through the PyTorch profiler), and by kind."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanoeuler.kernels.bf16.engine import TrainEngine

    torch.zeros(1, device="cuda")
    eng = TrainEngine(cfg, params_np, batch=B, seq=T, lr=3e-4, **options)
    ids, tg = [
        (cupy.asarray(i, dtype=np.int32), cupy.asarray(t, dtype=np.int32)) for i, t in _windows(cfg, B, T, 3, 1)
    ][0]
    for _ in range(3):
        eng.step(ids, tg)
    cupy.cuda.Stream.null.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            eng.step(ids, tg)
        cupy.cuda.Stream.null.synchronize()
    kinds: dict = {}
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not us or ev.key.startswith("ProfilerStep"):
            continue
        name = ev.key
        low = name.lower()
        kind = (
            "attention"
            if "flash" in low or "attn" in low
            else "gemm"
            if any(w in low for w in ("gemm", "sm90", "cutlass", "xmma", "cublas", "nvjet"))
            else "memcpy/memset"
            if "memcpy" in low or "memset" in low
            else "other"
        )
        kinds[kind] = kinds.get(kind, 0.0) + us / 2
        rows.append((us / 2, ev.count // 2, name[:90]))
    total = sum(kinds.values())
    log(
        f"profile B{B}xT{T} {options or 'defaults'} (attention {eng.attention}): {total / 1e3:.1f} ms of kernels "
        f"per step"
    )
    for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        log(f"  {kind:<14} {us / 1e3:8.2f} ms  {us / total:6.1%}")
    for us, n, name in sorted(rows, reverse=True)[:30]:
        log(f"  {us / 1e3:8.2f} ms  x{n:<4} {name}")
    del eng


# ---- bf16 vs fp32 agreement -----------------------------------------------------------------------


def agree(cfg, params_np, B, T, steps, log):
    """Train the same init on the same fixed sequence of batches with fp32 and with the bf16 engine."""
    import cupy

    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import transformer
    from nanoeuler.optim import AdamW, clip_grad_norm, lr_at

    # Fixed data: a new batch every step, all drawn up front from one first-order Markov chain over the
    # vocabulary (each token has 16 possible successors, drawn from a Zipf-like distribution, with random
    # probabilities), so the loss falls at once (token frequencies), then towards the chain's entropy,
    # and levels off there instead of reaching zero by memorisation.
    rng = np.random.default_rng(7)
    V, W = cfg.vocab_size, T + cfg.mtp_heads
    zipf = 1.0 / (np.arange(V) + 10.0)
    succ = rng.choice(V, size=(V, 16), p=zipf / zipf.sum())
    cum = np.cumsum(rng.dirichlet(np.full(16, 0.5), size=V), axis=1)
    state = rng.integers(0, V, size=steps * B)
    seq = np.empty((steps * B, W), dtype=np.int64)
    for t in range(W):
        seq[:, t] = state
        idx = np.minimum((rng.random(state.size)[:, None] > cum[state]).sum(1), 15)
        state = succ[state, idx]
    data = []
    for j in range(steps):
        w = seq[j * B : (j + 1) * B]
        data.append((w[:, :T], np.stack([w[:, 1 + k : T + 1 + k] for k in range(cfg.mtp_heads)], axis=-1)))
    probs = np.diff(np.concatenate([np.zeros((V, 1)), cum], axis=1))
    entropy = float(np.mean(-np.sum(probs * np.log(np.maximum(probs, 1e-30)), axis=1)))
    log(f"  data: {steps} batches of Markov-chain tokens; next-token entropy {entropy:.3f} nats")

    def lr(s):
        return lr_at(s, max_lr=6e-4, min_lr=6e-5, warmup_steps=min(30, steps // 10), total_steps=steps)

    out = {}
    params = {n: cupy.asarray(p) for n, p in params_np.items()}
    opt = AdamW(params, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gpu_data = [(cupy.asarray(i), cupy.asarray(t)) for i, t in data]
    losses = []
    t0 = time.perf_counter()
    for s in range(steps):
        ids, tg = gpu_data[s % len(gpu_data)]
        loss, grads = transformer.loss_and_grads(params, ids, tg, cfg)
        clip_grad_norm(grads, 1.0)
        opt.step(params, grads, lr(s))
        del grads
        losses.append(loss)
    out["fp32"] = losses
    log(f"  fp32 {steps} steps in {time.perf_counter() - t0:.1f} s")
    del params, opt
    cupy.get_default_memory_pool().free_all_blocks()
    eng = TrainEngine(cfg, params_np, batch=B, seq=T, lr=6e-4)
    gpu_data = [(cupy.asarray(i, dtype=np.int32), cupy.asarray(t, dtype=np.int32)) for i, t in data]
    dev_losses = []
    t0 = time.perf_counter()
    for s in range(steps):
        ids, tg = gpu_data[s % len(gpu_data)]
        eng.step(ids, tg, lr=lr(s))
        dev_losses.append(eng.loss_buffer().copy())
    out["bf16"] = [float(x) for x in cupy.stack(dev_losses).get()]
    log(f"  bf16 {steps} steps in {time.perf_counter() - t0:.1f} s")
    return out


# ---- main ------------------------------------------------------------------------------------------


def clocks_columns(summary) -> str:
    """The table's MHz, W and capped columns of a `PowerSampler.summary` (dashes without one).

    >>> clocks_columns({"mhz": 1650.0, "watts": 693.4, "capped": 0.9, "samples": 31})
    ' 1650  693    90%'
    >>> clocks_columns(None)
    '    -    -      -'
    """
    if not summary:
        return f"{'-':>5} {'-':>4} {'-':>6}"
    return f"{summary['mhz']:>5.0f} {summary['watts']:>4.0f} {summary['capped']:>6.0%}"


def release_gpu_memory() -> None:
    """Give back the memory of the mode that just returned: its model, optimizer state and batches went
    with its frame (its step closure too), the collector frees the cycles among them (torch.compile makes
    some), then PyTorch's and CuPy's caches are emptied for the next mode."""
    gc.collect()
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()
    if "cupy" in sys.modules:
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


def run_rows(cfg, params_np, rows, modes, args, power, log) -> list:
    """Each mode at each (B, T) row, one after another: a result dict per mode that ran (a failing mode is
    reported and skipped), its "span" the time of its timed steps (see PowerSampler)."""
    results = []
    for B, T in rows:
        fpt = flops_per_token(cfg, T)
        for mode in modes:
            log(f"{mode} B{B}xT{T}")
            t0 = time.perf_counter()
            span = power.span()
            try:
                if mode == "torch-eager":
                    ms, peak, loss = torch_run(cfg, params_np, B, T, args.steps, args.warmup, False, log, span)
                elif mode == "torch-compile":
                    ms, peak, loss = torch_run(cfg, params_np, B, T, args.steps, args.warmup, True, log, span)
                elif mode == "ours-fp32":
                    ms, peak, loss = ours_fp32_run(cfg, params_np, B, T, args.fp32_steps or args.steps, 2, log, span)
                elif mode == "ours-bf16" or mode.startswith("ours-bf16-"):
                    ms, peak, loss = ours_bf16_run(
                        cfg, params_np, B, T, args.steps, args.warmup, log, span, **engine_options(mode)
                    )
                else:
                    raise ValueError(f"unknown mode {mode}")
            except Exception as exc:  # one failing mode must not lose the other rows
                import traceback

                traceback.print_exc()
                log(f"  {mode} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            finally:
                release_gpu_memory()
            tps = B * T / ms * 1e3
            results.append(
                dict(
                    mode=mode,
                    B=B,
                    T=T,
                    ms=ms,
                    tokens_s=tps,
                    tflops=tps * fpt / 1e12,
                    mfu=tps * fpt / PEAK_BF16,
                    peak_gib=peak / 2**30,
                    loss=loss,
                    span=span,
                    wall_s=time.perf_counter() - t0,
                )
            )
            log(f"  {ms:.1f} ms/step, {tps:,.0f} tokens/s, peak {peak / 2**30:.2f} GiB")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpu")
    ap.add_argument("--rows", default="16x512,16x1024,64x512", help="comma-separated BxT")
    ap.add_argument("--modes", default=",".join(ALL_MODES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fp32-steps", type=int, default=0, help="timed steps for ours-fp32 (default --steps)")
    ap.add_argument("--agree", type=int, default=0, metavar="STEPS", help="bf16 vs fp32 training run instead")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--profile", action="store_true", help="print the engine's kernel-time breakdown per row")
    args = ap.parse_args(argv)

    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig

    cfg = ModelConfig.named(args.preset)
    params_np = transformer.init_params(cfg, seed=0)

    def log(msg):
        print(msg, flush=True)

    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    if args.agree:
        B, T = 16, cfg.ctx_len
        log(f"agreement: {name}, preset {args.preset}, B{B}xT{T}, {args.agree} steps, fixed data")
        res = agree(cfg, params_np, B, T, args.agree, log)
        f, b = res["fp32"], res["bf16"]
        for s in list(range(0, args.agree, max(1, args.agree // 10))) + [args.agree - 1]:
            log(f"  step {s + 1:>4}  fp32 {f[s]:.4f}  bf16 {b[s]:.4f}  rel {abs(b[s] - f[s]) / f[s]:.2%}")
        tail_f = float(np.mean(f[-10:]))
        tail_b = float(np.mean(b[-10:]))
        rel = abs(tail_b - tail_f) / tail_f
        log(
            f"final (mean of the last 10 steps): fp32 {tail_f:.4f}  bf16 {tail_b:.4f}  "
            f"rel diff {rel:.2%}  {'within 2%' if rel <= 0.02 else 'OUTSIDE 2%'}"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(res))
        return 0 if rel <= 0.02 else 1

    modes = [m for m in args.modes.split(",") if m]
    rows = [tuple(int(v) for v in r.split("x")) for r in args.rows.split(",") if r]
    import torch

    log(
        f"device {name}; torch {torch.__version__}, cupy {cupy.__version__}; preset {args.preset} "
        f"({cfg.n_params():,} params); {args.steps} timed steps after {args.warmup} warm-up"
    )
    power = PowerSampler(cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.Device().id))
    with power:
        results = run_rows(cfg, params_np, rows, modes, args, power, log)
    for r in results:
        r["clocks"] = power.summary(r.pop("span"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    log("")
    log(
        f"{'row':<10} {'mode':<14} {'ms/step':>8} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8} "
        f"{'x eager':>8} {'x compile':>9} {'mem/compile':>11} {'MHz':>5} {'W':>4} {'capped':>6}"
    )
    for r in results:
        ref = {m["mode"]: m for m in results if (m["B"], m["T"]) == (r["B"], r["T"])}
        e = ref.get("torch-eager")
        c = ref.get("torch-compile")
        log(
            f"B{r['B']}xT{r['T']:<5} {r['mode']:<14} {r['ms']:>8.1f} {r['tokens_s']:>9,.0f} {r['tflops']:>8.1f} "
            f"{r['mfu']:>6.1%} {r['peak_gib']:>8.2f} "
            f"{(r['tokens_s'] / e['tokens_s']) if e else float('nan'):>8.2f} "
            f"{(r['tokens_s'] / c['tokens_s']) if c else float('nan'):>9.2f} "
            f"{(r['peak_gib'] / c['peak_gib']) if c else float('nan'):>11.2f} {clocks_columns(r['clocks'])}"
        )
    if args.profile:  # after the timings: the profiler must not slow the timed runs
        ours = [m for m in modes if m.startswith("ours-bf16")] or ["ours-bf16"]
        for B, T in rows:
            for mode in ours:
                try:
                    profile_engine(cfg, params_np, B, T, log, **engine_options(mode))
                except Exception as exc:
                    log(f"  profile failed: {type(exc).__name__}: {str(exc)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
