"""The whole training step on the GPU in mixed precision: bf16 GEMM operands, float32 everything else.

    >>> eng = Engine(cfg, params, batch=16, seq=512)            # params: NumPy or CuPy float32   # doctest: +SKIP
    >>> eng.step(inputs, targets, lr)   # forward, backward, clipping, AdamW; no host sync        # doctest: +SKIP
    >>> eng.last_loss()                 # reads the loss back (a sync; call it when logging)      # doctest: +SKIP

Same model and loss as `nanoeuler.model.transformer.loss_and_grads` followed by `optim.clip_grad_norm`
and `optim.AdamW.step`; the float32 path stays the reference (the self-test and the bf16-vs-fp32
training run in `bench/train_gpu.py --agree` compare against it).

Precision. Master weights, gradients, both AdamW moments, the residual stream, norms' statistics,
softmax and the loss are float32. Every matrix product runs on the tensor cores through cuBLAS
(`cublasGemmEx`, bf16 operands, float32 accumulation); its operands are bf16 copies: the weights (a
bf16 image of the master weights that the AdamW kernel rewrites after each update), the normed
activations, the SwiGLU output, the attention output and the gradients flowing into each GEMM.
Products write float32 where float32 is summed next: the weight gradients and the final norm's input
gradient (summed over the output heads). The others write bf16, as autocast's linear layers do: the
logits (the cross-entropy kernel reads them in float32 arithmetic and overwrites them with their bf16
gradient), the two branches that join the residual stream (o_proj, down), which the RMSNorm kernel
reading the stream next adds to the float32 stream (cuBLAS took about twice as long to read and
write the float32 stream itself), and the layers' normed-activation gradients, which the RMSNorm
backward reads in float32 arithmetic. Attention runs on the
tensor cores too (`flash_*` in bf16.cu: bf16 q/k/v/O/dO, float32 softmax statistics and accumulators)
for head sizes 32 and 64, in variants of the same arithmetic: `attention="ldm"` loads the mma operands
from shared memory with ldmatrix and streams the next tile in with cp.async while one is in use;
`"mma"` loads them with plain 32-bit loads and copies tiles synchronously (slower); `"wg"`, the default
for head size 64 on a compute-capability-9.0 GPU (H100, H200), runs every product as a warpgroup matrix
product (wgmma, sm_90a) on whole 64 x 64 tiles, the tensor cores reading the tiles from shared memory
themselves: the streamed ones, and the block's own rows, copied once (`flash_kernels`). The backward
runs in two kernels (dq, which also computes delta = rowsum(dO * O), then dk/dv; each recomputes S and
dP, and neither uses atomics, so attention's gradients are deterministic) that write dq, dk (with the
RoPE rotation undone) and dv as bf16 straight into the gradient operand of the qkv GEMM.
`attention="fp32"` selects the float32 FlashAttention of `attention.cu` on float32 q/k/v instead (the
only choice for other head sizes).

Norm gains folded into the weights. Each RMSNorm feeds one stacked GEMM (the first norm qkv, the second
gate/up, the final norm the output heads), and (xhat * gain) W^T = xhat (W * gain)^T, where W * gain
scales column j of W by gain[j]. So the norms write xhat = x / rms(x) alone, the GEMM image of those
matrices is bf16(W * gain) (written by AdamW, which updates the gains first), and the backward's GEMM
through the same image gives dL/dxhat. The norm's backward then needs only xhat (bf16, kept from the
forward) and 1/rms: not the float32 residual stream, so the stream is never kept. The weight-gradient
GEMM gives dW' = dy^T xhat, the gradient of the folded matrix; `gain_fold_grad` turns it into dW =
dW' * gain and the gain's gradient, the column sums of W * dW' (`layers.folded_gain_grads` is the
reference). The arithmetic is the model's; only where bf16 rounding falls moves (bf16(W * gain) and
bf16(xhat) where autocast rounds W and xhat * gain).

Memory. All tensors live in buffers allocated once in `__init__`: flat float32 arrays for parameters,
gradients and both moments, the flat bf16 image, the per-layer activations kept for the backward (the
two norms' xhat as bf16 and their 1/rms, q/k/v, the attention output and its logsumexp, the gate/up
product), and scratch shared by all layers (scratch with disjoint lifetimes shares memory: the MLP's
and the output heads'). The residual stream lives in two buffers that alternate by layer, and the
stream after each attention half is never stored: the norm that reads it sums the layer's input and
the o_proj branch. A step allocates nothing, and the host never waits on the device inside it: the
per-head loss normalisation, the global gradient norm and the clipping factor are computed and
consumed on the device.

The SwiGLU inside its GEMMs (`fuse_swiglu`, the default where `can_fuse_swiglu`: sm_90a, dim % 64 == 0,
hidden % 128 == 0). Forward: `swiglu_fwd_gemm` (bf16.cu) computes gate/up tile by tile on the tensor
cores and writes m = silu(gate) * up next to them from the same registers, so nothing reads gu back.
Backward: dm = dy Wd is read only by the SwiGLU backward, so `swiglu_bwd_gemm` computes dm tile by tile
and applies the SwiGLU backward to the tile in registers: dm never goes to memory. Their operands arrive
by TMA copies (tensor maps: `tma.py`): xhat2 and the bf16 image's Wgu (in the lanes' row order, a view),
dxb and `wdt`, an image of every layer's Wd transposed and permuted that `wdt_image` rewrites after
each AdamW step. Elsewhere cuBLAS writes gu and dm, and `swiglu_fwd_bf16` / `swiglu_bwd_bf16` read them.

RoPE inside the qkv GEMM (`fuse_rope`, the default where `can_fuse_rope`: sm_90a, head size 64, dim % 64
== 0, seq % 64 == 0, bf16 attention): `qkv_rope_gemm` computes qkv tile by tile (128 rows x 2 heads),
rotates q and k in registers and stores every head straight into q/k/v in the attention layout, by
TMA through `tma.heads_map`. Elsewhere cuBLAS writes qkv and `qkv_rope_split_bf16` reads it.

Launches per step: 7 per layer forward, 16 per layer backward (9 and 17 without the fused kernels),
4 per head and chunk of output-head rows, and a few dozen for the optimizer (one AdamW launch per run
of equally-decayed tensors, and one per gain-folded matrix, and one for `wdt_image`).
From the second step on, `step` replays the whole step as one CUDA graph, captured once on the
engine's own stream: the GPU runs the kernels back to back instead of waiting for each launch. (CuPy
refuses cuBLAS calls during capture, so the GEMMs call cuBLAS through ctypes: see `cublas.py`.)
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import cupy as cp
import numpy as np

from nanoeuler.kernels import has_sm90a, kernel
from nanoeuler.kernels.cublas import BF16_STORAGE, Gemm, Matrix
from nanoeuler.kernels.tma import gate_up_map, heads_map, tile_map
from nanoeuler.model import layers
from nanoeuler.model.config import ModelConfig
from nanoeuler.optim import default_no_decay

_ALIGN = 64  # elements: every tensor of the flat buffers starts 256-byte aligned (float32)
_FLASH = {16: (1, 128), 32: (1, 128), 64: (2, 64), 128: (4, 32)}  # as in ops.py / attention.cu
_MMA_HEAD_DIMS = (32, 64)  # tensor-core FlashAttention of bf16.cu
ATTENTION_VARIANTS = ("wg", "ldm", "mma", "fp32")

_NULL = np.uint64(0)  # a null pointer argument (an optional input or output a kernel skips)
# The fused GEMM kernels (bf16.cu): two warpgroups in ping-pong and a producer warp; shared memory = 1 KiB of
# alignment, SG_STAGES stages of 32 KiB and their 2 SG_STAGES mbarriers, and the epilogue's 8 KiB boxes of
# 64 x 64, per warpgroup: in the SwiGLU forward gate, up and m of both 64-row halves of its tile (6), in the
# backward gate and up (4, then d(gate) and d(up) over them) and m (2) of two 64 x 64 quarters at a time,
# with an mbarrier per quarter's buffer; in the qkv product with RoPE the two heads of both halves (4).
SWIGLU_GEMM_THREADS = 288
SWIGLU_FWD_GEMM_SMEM = 1024 + 4 * 32768 + 12 * 8192 + 8 * 8
SWIGLU_BWD_GEMM_SMEM = 1024 + 4 * 32768 + 12 * 8192 + 12 * 8
QKV_ROPE_GEMM_SMEM = 1024 + 4 * 32768 + 8 * 8192 + 8 * 8
# The warpgroup attention (bf16.cu's flash_*_wg_d64) keeps 64 x 64 bf16 tiles of 8 KiB in dynamic shared
# memory, after 1 KiB of alignment: the forward K and V in two stages and the block's Q (5 tiles); dq K
# and V in two stages, the block's Q and dO (6); dk/dv Q and dO in two stages, the block's K and V (6).
# Operands that stay the same for a whole block are read by the tensor cores from there rather than
# from registers, which leaves room for more blocks per multiprocessor (5, 4 and 3).
FLASH_WG_SMEM = {"flash_fwd": 1024 + 5 * 8192, "flash_bwd_dq": 1024 + 6 * 8192, "flash_bwd_dkdv": 1024 + 6 * 8192}
_FOLD_SPLITS = 64  # row splits of gain_fold_grad at most (its column sums are reduced by column_sums)


def carve(tensors) -> tuple[list, int]:
    """[(shape, dtype)] -> ([(byte offset, bytes, shape, dtype)], total bytes): tensors laid out one
    after another in one byte buffer, each 256-byte aligned."""
    out, off = [], 0
    for shape, dt in tensors:
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        out.append((off, n, shape, dt))
        off += -(-n // 256) * 256
    return out, off


def mlp_scratch(N: int, F: int, fused: bool = False) -> list:
    """(shape, dtype) of the MLP's scratch: m = silu(gate) * up, d(gate|up), and (unless the SwiGLU
    backward runs inside its GEMM, `swiglu_bwd_gemm`) dm, the gradient of m."""
    return [((N, F), BF16_STORAGE), ((N, 2 * F), BF16_STORAGE)] + ([] if fused else [((N, F), BF16_STORAGE)])


def sg_row(j: int) -> int:
    """Row of a 128-row block of `wdt_image` that holds column j (0..127) of the block (bf16.cu's sg_row):
    the order that gives each lane of `swiglu_bwd_gemm` 8 consecutive hidden columns.

        >>> [sg_row(j) for j in (0, 1, 2, 8, 32)]
        [0, 1, 8, 2, 32]
    """
    return ((((j >> 5) << 2) + ((j >> 1) & 3)) << 3) + (((j >> 3) & 3) << 1) + (j & 1)


def wdt_image_rows(F: int) -> np.ndarray:
    """The row of `wdt_image`'s output that holds each of the F columns of Wd (F % 128 == 0).

        >>> wdt_image_rows(256)[[0, 2, 130]]
        array([  0,   8, 136])
    """
    return np.array([c // 128 * 128 + sg_row(c % 128) for c in range(F)])


def prepare_fused_gemm(fn):
    """`fn`, one of the GEMM kernels with an epilogue inside (the fused SwiGLU kernels, `qkv_rope_gemm`),
    allowed the shared memory they need (more than the default 48 KiB)."""
    fn.max_dynamic_shared_size_bytes = max(SWIGLU_FWD_GEMM_SMEM, SWIGLU_BWD_GEMM_SMEM, QKV_ROPE_GEMM_SMEM)
    return fn


def flash_kernels(variant: str, D: int) -> dict:
    """{"flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv": launch(grid, block, args)}: bf16.cu's tensor-core
    attention of one variant ("wg", "ldm" or "mma") and head size D, each launch with the shared memory
    its kernel needs (FLASH_WG_SMEM for "wg"; the others' is static)."""
    out = {}
    for name, smem in FLASH_WG_SMEM.items():
        fn = kernel("bf16", f"{name}_{variant}_d{D}")
        smem = smem if variant == "wg" else 0
        if smem:
            fn.max_dynamic_shared_size_bytes = smem
        out[name] = functools.partial(fn, shared_mem=smem)
    return out


def run_qkv_rope_gemm(fn, x_map, w_map, q_map, k_map, v_map, cos, sin, N: int, C: int, T: int, H: int, Hkv: int,
                      sms: int) -> None:
    """qkv = xhat Wqkv^T, q and k rotated by RoPE (cos/sin: (T, 32) float32), into q (B, H, T, 64) and k, v
    (B, Hkv, T, 64), T % 64 == 0; xhat (N = B T rows) and Wqkv through `tile_map`s with boxes of 128 rows,
    q/k/v through `heads_map`s (bf16.cu's qkv_rope_gemm)."""
    i32 = np.int32
    fn(qkv_rope_gemm_grid(N, H + 2 * Hkv, sms), (SWIGLU_GEMM_THREADS,),
       (x_map, w_map, q_map, k_map, v_map, cos, sin, i32(N), i32(C), i32(T), i32(H), i32(Hkv)),
       shared_mem=QKV_ROPE_GEMM_SMEM)


def qkv_rope_gemm_grid(N: int, heads: int, sms: int) -> tuple:
    """Grid of `qkv_rope_gemm`: a block per multiprocessor, at most one per tile of 128 rows x 2 heads.

        >>> qkv_rope_gemm_grid(32768, 20, sms=132), qkv_rope_gemm_grid(192, 7, sms=132)
        ((132,), (8,))
    """
    return (min(sms, -(-N // 128) * -(-heads // 2)),)


def can_fuse_rope(C: int, D: int, T: int, attention: str) -> bool:
    """Whether `qkv_rope_gemm` takes this model and sequence length on this GPU: head size 64, C % 64 == 0,
    T % 64 == 0, sm_90a, bf16 attention operands."""
    return D == 64 and C % 64 == 0 and T % 64 == 0 and attention != "fp32" and has_sm90a()


def run_swiglu_fwd_gemm(fn, x_map, w_map, gu_map, m_map, N: int, C: int, F: int, sms: int) -> None:
    """gu = xhat Wgu^T and m = silu(gate) * up, from xhat (through `x_map`: `tile_map` with boxes of 128
    rows) and Wgu (through `w_map`: `gate_up_map`), into gu (N, 2F) and m (N, F) (through `gu_map` and
    `m_map`: `tile_map` with boxes of 64 rows) (bf16.cu's swiglu_fwd_gemm)."""
    i32 = np.int32
    fn(swiglu_gemm_grid(N, F, sms, 64), (SWIGLU_GEMM_THREADS,), (x_map, w_map, gu_map, m_map, i32(N), i32(C), i32(F)),
       shared_mem=SWIGLU_FWD_GEMM_SMEM)


def run_swiglu_bwd_gemm(fn, dy_map, wdt_map, wdt_row0: int, gu_map, dgu_map, m_map, N: int, C: int, F: int,
                        sms: int) -> None:
    """d(gate|up) and m, from dy (through `dy_map`: `tile_map`, boxes of 128 rows), the rows wdt_row0 ..
    wdt_row0 + F of a `wdt_image` output (through `wdt_map`, the same) and gu; gu, dgu (N, 2F) and m (N, F)
    through `tile_map`s with boxes of 64 rows (bf16.cu's swiglu_bwd_gemm)."""
    i32 = np.int32
    fn(swiglu_gemm_grid(N, F, sms), (SWIGLU_GEMM_THREADS,),
       (dy_map, wdt_map, i32(wdt_row0), gu_map, dgu_map, m_map, i32(N), i32(C), i32(F)),
       shared_mem=SWIGLU_BWD_GEMM_SMEM)


def swiglu_gemm_grid(N: int, F: int, sms: int, tile_units: int = 128) -> tuple:
    """Grid of a persistent fused SwiGLU kernel: a block per multiprocessor, at most one per tile of 128 rows
    x `tile_units` hidden units (128 in the backward, 64 in the forward).

        >>> swiglu_gemm_grid(32768, 2048, sms=132), swiglu_gemm_grid(300, 1024, sms=132)
        ((132,), (24,))
        >>> swiglu_gemm_grid(300, 1024, sms=132, tile_units=64)
        (48,)
    """
    return (min(sms, -(-N // 128) * (F // tile_units)),)


def can_fuse_swiglu(C: int, F: int) -> bool:
    """Whether the fused SwiGLU kernels take these widths (k steps of 64 of C; tiles of 64 or 128 units of
    F) on this GPU (sm_90a)."""
    return C % 64 == 0 and F % 128 == 0 and has_sm90a()


def head_chunk_rows(N: int, V: int, arena_bytes: int, chunk_bytes: int | None = None) -> int:
    """Rows of one output-head chunk (bf16 logits, overwritten by their gradient: 2V bytes a row).

    By default as many rows as the MLP's scratch holds (the heads run while it is dead), and at least
    64 MiB of logits; `chunk_bytes` caps the logits at that many bytes instead. The rows are then spread
    evenly over the chunks: larger chunks make larger, more efficient GEMMs.

        >>> head_chunk_rows(N=32768, V=4096, arena_bytes=8 * 32768 * 2048)     # B64xT512: one chunk
        32768
        >>> head_chunk_rows(N=40000, V=4096, arena_bytes=2**28)   # 32768 rows fit: 2 chunks of 20000
        20000
        >>> head_chunk_rows(N=1000, V=4096, arena_bytes=0, chunk_bytes=2 * 4096 * 48)   # 21 chunks
        48
    """
    if chunk_bytes is None:
        rows = max(2**26, arena_bytes) // (2 * V)
    else:
        rows = chunk_bytes // (2 * V)
    rows = max(1, min(N, rows))
    return -(-N // -(-N // rows))


def gain_fold_splits(rows: int) -> tuple[int, int]:
    """(row splits, rows per split) of `gain_fold_grad` over a matrix of `rows` rows: splits of at least
    32 rows, at most _FOLD_SPLITS of them (their column sums are then added by `column_sums`).

        >>> gain_fold_splits(1280), gain_fold_splits(16384), gain_fold_splits(37)
        ((40, 32), (64, 256), (2, 19))
    """
    splits = min(_FOLD_SPLITS, -(-rows // 32))
    return splits, -(-rows // splits)


def gain_fold_columns(C: int) -> int:
    """Columns per block of `gain_fold_grad`: 4 per lane (16-byte accesses) when C is a multiple of 4."""
    return 128 if C % 4 == 0 else 32


def _grid(n, threads=256, cap=65535 * 8):
    return (max(1, min(cap, (n + threads - 1) // threads)),)


class Engine:
    """One model's weights, optimizer state and activation buffers on the GPU, for a fixed (batch, seq)."""

    def __init__(self, cfg: ModelConfig, params: dict, *, batch: int, seq: int, lr: float = 3e-4,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1, max_norm: float = 1.0,
                 no_decay=None, chunk_bytes: int | None = None, attention: str = "auto", graph: bool = True,
                 fuse_swiglu: bool | None = None, fuse_rope: bool | None = None):
        if attention == "auto":
            attention = ("wg" if cfg.head_dim == 64 and has_sm90a() else
                         "ldm" if cfg.head_dim in _MMA_HEAD_DIMS else "fp32")
        if (attention not in ATTENTION_VARIANTS or (attention != "fp32" and cfg.head_dim not in _MMA_HEAD_DIMS)
                or (attention == "wg" and (cfg.head_dim != 64 or not has_sm90a()))):
            raise ValueError(f"attention {attention!r} for head_dim {cfg.head_dim}"
                             + (" (needs head_dim 64 on a compute-capability-9.0 GPU)" if attention == "wg" else ""))
        self.attention = attention
        if fuse_swiglu is None:
            fuse_swiglu = can_fuse_swiglu(cfg.dim, cfg.hidden)
        elif fuse_swiglu and not can_fuse_swiglu(cfg.dim, cfg.hidden):
            raise ValueError(f"fuse_swiglu needs dim % 64 == 0 and hidden % 128 == 0 on a compute-capability-9.0 "
                             f"GPU (dim {cfg.dim}, hidden {cfg.hidden})")
        self.fuse_swiglu = bool(fuse_swiglu)
        if fuse_rope is None:
            fuse_rope = can_fuse_rope(cfg.dim, cfg.head_dim, int(seq), attention)
        elif fuse_rope and not can_fuse_rope(cfg.dim, cfg.head_dim, int(seq), attention):
            raise ValueError(f"fuse_rope needs head_dim 64, dim % 64 == 0, seq % 64 == 0 and bf16 attention on a "
                             f"compute-capability-9.0 GPU (head_dim {cfg.head_dim}, dim {cfg.dim}, seq {seq}, "
                             f"attention {attention!r})")
        self.fuse_rope = bool(fuse_rope)
        self.sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        if cfg.head_dim not in _FLASH:
            raise ValueError(f"head_dim {cfg.head_dim} not supported by the attention kernels ({sorted(_FLASH)})")
        self.cfg = cfg
        self.B, self.T = int(batch), int(seq)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay, self.max_norm = float(eps), float(weight_decay), float(max_norm)
        self.lr = float(lr)
        self.t = 0
        L, C, H, Hkv, D, F, V, K = (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden,
                                    cfg.vocab_size, cfg.mtp_heads)
        B, T = self.B, self.T
        N = B * T
        self.N = N
        HD, KD = H * D, Hkv * D
        self.QKV = HD + 2 * KD
        shapes = cfg.param_shapes()
        if no_decay is None:
            no_decay = {n for n, s in shapes.items() if default_no_decay(n, s)}
        self.no_decay = set(no_decay)

        # ---- flat layout: groups of tensors that one GEMM reads as a single stacked matrix ----
        # (tensors, the norm gain folded into them or None): the qkv and gate/up projections and the
        # output heads read a norm's output, and their GEMM image carries that norm's gain (see __doc__).
        groups = [(["embed_tokens.weight"], None)]
        for i in range(L):
            p = f"layers.{i}."
            groups += [([p + "input_layernorm.weight"], None), ([p + "post_attention_layernorm.weight"], None)]
        groups.append((["norm.weight"], None))
        for i in range(L):
            p = f"layers.{i}."
            groups += [([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                        p + "input_layernorm.weight"), ([p + "self_attn.o_proj.weight"], None),
                       ([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "post_attention_layernorm.weight"),
                       ([p + "mlp.down_proj.weight"], None)]
        groups.append((["lm_head.weight"] + [f"mtp_heads.{k}.weight" for k in range(1, K)], "norm.weight"))
        # Stable sort: the gain-folded matrices last, so that AdamW updates every gain before the images
        # that fold it in, and the gradient norm's plain sum covers a prefix; undecayed before decayed.
        groups.sort(key=lambda g: (g[1] is not None, g[0][0] not in self.no_decay))
        self.offsets: dict[str, int] = {}
        self.group_of: dict[str, tuple[int, int]] = {}
        self.gain_of: dict[str, str] = {}  # matrix name -> the norm gain folded into its GEMM image
        runs: list[list] = []  # [start, end, decayed, gain name or None, columns]: one AdamW launch each
        off = 0
        for names, gain in groups:
            decayed = {n not in self.no_decay for n in names}
            if len(decayed) != 1:
                raise ValueError(f"tensors {names} are read by one GEMM but differ in weight decay")
            d = decayed.pop()
            start = off
            for n in names:
                self.offsets[n] = off
                off += int(np.prod(shapes[n]))
                if gain is not None:
                    self.gain_of[n] = gain
            for n in names:
                self.group_of[n] = (start, off)
            if gain is not None and off - start >= 2**31:
                raise ValueError(f"tensors {names} exceed the 32-bit indexing of the gain-folding kernels")
            end = -(-off // _ALIGN) * _ALIGN
            if gain is None and runs and runs[-1][2] == d and runs[-1][3] is None and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end, d, gain, shapes[names[0]][-1]])
            off = end
        if set(self.offsets) != set(shapes):
            raise ValueError("flat layout does not cover the parameters")
        self.total = off
        self.fold_start = min((r[0] for r in runs if r[3] is not None), default=off)
        self.shapes = shapes

        f32, bf = np.float32, BF16_STORAGE
        self.P = cp.zeros(off, dtype=f32)  # master weights
        self.G = cp.zeros(off, dtype=f32)  # gradients
        self.Mo = cp.zeros(off, dtype=f32)  # AdamW first moment
        self.Vo = cp.zeros(off, dtype=f32)  # AdamW second moment
        self.Pb = cp.zeros(off, dtype=bf)  # bf16 image of P
        for n, s in shapes.items():
            src = params[n]
            if tuple(src.shape) != tuple(s):
                raise ValueError(f"parameter {n} has shape {tuple(src.shape)}, expected {s}")
            self.view(self.P, n)[...] = cp.asarray(src, dtype=f32)
        # the runs with their gains as device views (AdamW writes the image of a run times its gain)
        self.runs = [(start, end, d, _NULL if g is None else self.view(self.P, g), cols)
                     for start, end, d, g, cols in runs]
        self._k = {name: kernel("bf16", name) for name in (
            "f32_to_bf16", "embed_fwd", "embed_bwd", "rmsnorm_fwd_bf16", "rmsnorm_bwd_bf16",
            "rmsnorm_bwd_bf16_f32dy", "gain_fold_grad", "column_sums", "qkv_rope_split",
            "rope_bwd_pack", "attn_pack", "attn_delta", "swiglu_fwd_bf16", "swiglu_bwd_bf16", "ce_head_scale",
            "ce_heads_fwd_bwd", "ce_loss_reduce", "sumsq", "adamw_clip_bf16", "qkv_rope_split_bf16",
            "wdt_image")}
        if self.fuse_swiglu:
            self._swiglu_fwd_gemm = prepare_fused_gemm(kernel("bf16", "swiglu_fwd_gemm"))
            self._swiglu_bwd_gemm = prepare_fused_gemm(kernel("bf16", "swiglu_bwd_gemm"))
            # every layer's Wd transposed, rows permuted (`wdt_image`): the fused backward's k-contiguous
            # operand, rewritten with the bf16 image
            self.wdt = cp.empty((L, F, C), dtype=BF16_STORAGE)
            self.wd_offsets = cp.asarray([self.offsets[f"layers.{i}.mlp.down_proj.weight"] for i in range(L)],
                                         dtype=np.int64)
        if self.fuse_rope:
            self._qkv_rope_gemm = prepare_fused_gemm(kernel("bf16", "qkv_rope_gemm"))
        if attention != "fp32":  # "mma": B fragments by 32-bit shared loads; "ldm": by ldmatrix; "wg": wgmma
            self._mma = flash_kernels(attention, D)
        self._flash = {name: kernel("attention", f"{name}_d{D}") for name in ("flash_fwd", "flash_bwd_dkdv",
                                                                                "flash_bwd_dq")}
        # The engine's work runs on a stream of its own (capturable into a CUDA graph; see `step`), ordered
        # against the caller's current stream by events.
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.gemm = Gemm(self.stream)
        self.graph = bool(graph)
        self._graph = None  # the captured step, after one step run kernel by kernel
        self._eager_steps = 0
        self.hyper = cp.zeros(3, dtype=f32)  # AdamW's per-step values (step size, 1/sqrt(bc2), decay factor)
        self._hyper_host = np.zeros(3, dtype=f32)
        self._refresh_image()

        # ---- weight views (bf16 for GEMMs, float32 gradient views of the same stacking) ----
        def wb(first, rows):  # bf16 stacked matrix starting at tensor `first`
            o = self.offsets[first]
            return Matrix(self.Pb[o:o + rows * self._cols(first)].reshape(rows, self._cols(first)))

        def wg(first, rows):
            o = self.offsets[first]
            return Matrix(self.G[o:o + rows * self._cols(first)].reshape(rows, self._cols(first)))

        def fold_args(first, gain):
            """What the backward needs to turn the gradient of a gain-folded GEMM image into the gradients
            of the matrix and of the gain: (W, dW as flat float32 views, the gain, its gradient, rows)."""
            start, end = self.group_of[first]
            return (self.P[start:end], self.G[start:end], self.view(self.P, gain), self.view(self.G, gain),
                    (end - start) // self._cols(first))

        self.Lw = []
        for i in range(L):
            p = f"layers.{i}."
            self.Lw.append(dict(
                qkv=wb(p + "self_attn.q_proj.weight", self.QKV), o=wb(p + "self_attn.o_proj.weight", C),
                gu=wb(p + "mlp.gate_proj.weight", 2 * F), d=wb(p + "mlp.down_proj.weight", C),
                dqkv=wg(p + "self_attn.q_proj.weight", self.QKV), do=wg(p + "self_attn.o_proj.weight", C),
                dgu=wg(p + "mlp.gate_proj.weight", 2 * F), dd=wg(p + "mlp.down_proj.weight", C),
                fold_qkv=fold_args(p + "self_attn.q_proj.weight", p + "input_layernorm.weight"),
                fold_gu=fold_args(p + "mlp.gate_proj.weight", p + "post_attention_layernorm.weight")))
        heads = ["lm_head.weight"] + [f"mtp_heads.{h}.weight" for h in range(1, K)]
        self.w_head = [wb(n, V) for n in heads]
        self.dw_head = [wg(n, V) for n in heads]
        self.fold_heads = fold_args("lm_head.weight", "norm.weight")
        self.emb = self.view(self.P, "embed_tokens.weight")
        self.demb = self.view(self.G, "embed_tokens.weight")

        # ---- activations kept for the backward (per layer) and scratch ----
        def e(shape, dt=f32):
            return cp.empty(shape, dtype=dt)

        # The residual stream lives in two float32 buffers that alternate by layer: the backward never
        # reads it. Each norm's output xhat (bf16, no gain: the gains are folded into the weights that read
        # it) and 1/rms are what the backward keeps of the norms. The branches that join the stream (o_proj,
        # down) are bf16 and are added in by the norm that reads the stream next.
        self.xs = [e((N, C)), e((N, C))]  # layer i reads the stream from xs[i % 2]
        self.ob = e((N, C), bf)  # the o_proj branch
        self.ybr = e((N, C), bf)  # the down branch
        self.xh1 = [e((N, C), bf) for _ in range(L)]  # xhat of each layer's first norm (input of qkv)
        self.xh2 = [e((N, C), bf) for _ in range(L)]  # xhat of its second norm (input of gate/up)
        self.rstd1 = [e(N) for _ in range(L)]
        self.rstd2 = [e(N) for _ in range(L)]
        qdt = bf if attention != "fp32" else f32  # the attention operands
        self.q = [e((B, H, T, D), qdt) for _ in range(L)]
        self.k = [e((B, Hkv, T, D), qdt) for _ in range(L)]
        self.v = [e((B, Hkv, T, D), qdt) for _ in range(L)]
        self.lse = [e((B, H, T)) for _ in range(L)]
        self.a = [e((N, HD), bf) for _ in range(L)]
        self.gu = [e((N, 2 * F), bf) for _ in range(L)]
        self.qkv = e((N, self.QKV), bf)  # the qkv GEMM's output in the forward, its gradient in the backward
        self.dqkv = self.qkv
        if attention == "fp32":
            self.att = e((B, H, T, D))  # fp32 attention output (forward) / dq (backward)
            self.dk = e((B, Hkv, T, D))
            self.dv = e((B, Hkv, T, D))
        if N * self.QKV // 16 >= 2**31:
            raise ValueError(f"batch {B} x seq {T} exceeds the 32-bit indexing of the RoPE kernels")
        # The MLP's scratch (m, dm, dgu) is dead while the output heads run, and the heads' chunk of
        # logits (overwritten by their gradient) is dead outside them: both are views of one arena.
        mlp, mlp_bytes = carve(mlp_scratch(N, F, self.fuse_swiglu))
        self.R = head_chunk_rows(N, V, mlp_bytes, chunk_bytes)
        self.arena = cp.empty(max(mlp_bytes, 2 * self.R * V), dtype=np.uint8)
        self.m, self.dgu, *dm = (self.arena[o:o + n].view(dt).reshape(sh) for o, n, sh, dt in mlp)
        self.dm = dm[0] if dm else None
        self.logits = self.arena[:2 * self.R * V].view(bf).reshape(self.R, V)  # then, in place, their gradient
        self.dh = e((N, C), bf)  # dL/dxhat of a layer's norm (a GEMM's output), into the norm's backward
        self.da = e((N, HD), qdt)  # gradient of the attention output
        self.delta = e((B, H, T))
        self.dx = e((N, C))
        self.dxb = e((N, C), bf)
        if self.fuse_swiglu:  # the fused SwiGLU kernels' TMA copies: boxes of 64 columns, 128 rows for the products
            self.dy_map = tile_map(self.dxb, 128)
            self.wdt_map = tile_map(self.wdt.reshape(L * F, C), 128)
            self.xh2_maps = [tile_map(x, 128) for x in self.xh2]
            self.wgu_maps = [gate_up_map(w["gu"].arr) for w in self.Lw]  # the bf16 image: rewritten in place
            self.gu_maps = [tile_map(x, 64) for x in self.gu]  # the epilogues' boxes: 64 rows x 64 columns
            self.m_map = tile_map(self.m, 64)
            self.dgu_map = tile_map(self.dgu, 64)
        if self.fuse_rope:  # qkv_rope_gemm's: xhat1 and Wqkv in boxes of 128 rows; q/k/v, a box per head, 64 positions
            self.xh1_maps = [tile_map(x, 128) for x in self.xh1]
            self.wqkv_maps = [tile_map(w["qkv"].arr, 128) for w in self.Lw]
            self.qkv_maps = [(heads_map(q), heads_map(k), heads_map(v)) for q, k, v in zip(self.q, self.k, self.v)]
        self.xn = e((N, C), bf)  # xhat of the final norm: the output heads' input
        self.rstdf = e(N)
        self.dxn = e((N, C))  # its dL/dxhat, summed over the heads
        self.gpart = e((_FOLD_SPLITS, C))  # per-split column sums of gain_fold_grad
        self.loss_rows = e((N, K))
        self.head_scale = e(K)
        self.loss = cp.zeros(1, dtype=f32)
        self.sq = cp.zeros(1, dtype=f32)
        self.ids = cp.zeros(N, dtype=np.int32)
        self.tg = cp.zeros((N, K), dtype=np.int32)
        self.cos, self.sin = layers.rope_tables(T, D, cfg.rope_theta, cp, np.float32)
        self.cos, self.sin = cp.ascontiguousarray(self.cos), cp.ascontiguousarray(self.sin)
        # matrix views used by the GEMMs
        self.mxh1, self.mxh2 = [Matrix(x) for x in self.xh1], [Matrix(x) for x in self.xh2]
        self.ma = [Matrix(x) for x in self.a]
        self.mgu = [Matrix(x) for x in self.gu]
        self.mybr = Matrix(self.ybr)
        self.mqkv, self.mm, self.mdgu = Matrix(self.qkv), Matrix(self.m), Matrix(self.dgu)
        self.mdm = None if self.dm is None else Matrix(self.dm)
        self.mdh, self.mda, self.mdqkv, self.mdxb = Matrix(self.dh), Matrix(self.da), Matrix(self.dqkv), Matrix(self.dxb)
        self.mob = Matrix(self.ob)
        cp.cuda.get_current_stream().synchronize()

    # ---- parameter access ----------------------------------------------------------------------------

    def _cols(self, name):
        s = self.shapes[name]
        return s[-1] if len(s) > 1 else 1

    def view(self, flat, name):
        o = self.offsets[name]
        s = self.shapes[name]
        return flat[o:o + int(np.prod(s))].reshape(s)

    def params(self) -> dict:
        """Master weights (float32 views into the engine's buffer; copy before keeping)."""
        return {n: self.view(self.P, n) for n in self.shapes}

    def grads(self) -> dict:
        """Gradients of the last `forward_backward` (before clipping; views)."""
        return {n: self.view(self.G, n) for n in self.shapes}

    def state_tensors(self) -> dict:
        """{"m.<name>", "v.<name>"} like `optim.AdamW.state_tensors` (views); the step count is `self.t`."""
        out = {}
        for n in self.shapes:
            out[f"m.{n}"] = self.view(self.Mo, n)
            out[f"v.{n}"] = self.view(self.Vo, n)
        return out

    def load_state(self, params: dict, tensors: dict | None = None, t: int = 0) -> None:
        """Set the master weights (and optionally the AdamW moments and step count), refresh the bf16 image."""
        for n in self.shapes:
            self.view(self.P, n)[...] = cp.asarray(params[n], dtype=np.float32)
            if tensors is not None:
                self.view(self.Mo, n)[...] = cp.asarray(tensors[f"m.{n}"], dtype=np.float32)
                self.view(self.Vo, n)[...] = cp.asarray(tensors[f"v.{n}"], dtype=np.float32)
        self.t = int(t)
        self._refresh_image()

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        """Restore the AdamW moments ({"m.<name>", "v.<name>"}, as `state_tensors` gives) and the step count."""
        self.load_state(self.params(), tensors, t)

    def _refresh_image(self) -> None:
        """The bf16 GEMM image of the master weights, the folded norm gains included."""
        for start, end, _, gain, cols in self.runs:
            n = end - start
            self._k["f32_to_bf16"](_grid(n), (256,), (self.P[start:end], self.Pb[start:end], np.int64(n), gain,
                                                      np.int32(cols)))
        self._refresh_wdt()

    def nbytes(self) -> int:
        """Device bytes of the engine's buffers (views into them, such as the arena's, not counted twice)."""
        arrays = []
        for v in self.__dict__.values():
            arrays += v if isinstance(v, list) else [v]
        owned = {id(a): a for a in arrays if isinstance(a, cp.ndarray) and a.base is None}
        return sum(a.nbytes for a in owned.values())

    def last_loss(self) -> float:
        """The loss of the last step (synchronises with the device)."""
        return float(self.loss[0])

    def loss_buffer(self):
        """The loss of the last step as a device array (no sync)."""
        return self.loss[0]

    def grad_norm(self) -> float:
        """Global gradient norm of the last step, before clipping (synchronises)."""
        return math.sqrt(float(self.sq[0]))

    # ---- the step ------------------------------------------------------------------------------------

    def _load_batch(self, inputs, targets):
        N, K = self.N, self.cfg.mtp_heads
        if tuple(inputs.shape) != (self.B, self.T) or tuple(targets.shape) != (self.B, self.T, K):
            raise ValueError(f"engine built for inputs ({self.B},{self.T}) and targets ({self.B},{self.T},{K}); "
                             f"got {tuple(inputs.shape)} and {tuple(targets.shape)}")
        cp.copyto(self.ids, cp.asarray(inputs).reshape(N), casting="unsafe")
        cp.copyto(self.tg, cp.asarray(targets).reshape(N, K), casting="unsafe")

    @contextlib.contextmanager
    def _on_stream(self):
        """Queue the engine's work on its stream, after what the caller's current stream has queued and
        before what it queues next (events: the host does not wait)."""
        caller = cp.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        with self.stream:
            yield
        caller.wait_event(self.stream.record())

    def forward_backward(self, inputs, targets) -> None:
        """Loss into `self.loss`, gradients into `self.G`, sum of squared gradients into `self.sq`."""
        self._load_batch(inputs, targets)
        with self._on_stream():
            self._forward_backward()

    def recompute_grad_norm(self) -> None:
        """The sum of squared gradients in `self.sq` again, from `self.G` as it is now (after a change of the
        gradients between `forward_backward` and `optimizer_step`, such as an all-reduce)."""
        with self._on_stream():
            cp.cuda.runtime.memsetAsync(self.sq.data.ptr, 0, 4, self.stream.ptr)
            self._k["sumsq"]((min(4096, -(-self.total // 256)),), (256,), (self.G, np.int64(self.total), self.sq))

    def optimizer_step(self, lr: float) -> None:
        """Clip (by the norm in `self.sq`) and apply AdamW to every parameter; refresh the bf16 image."""
        self._set_hyper(lr)
        with self._on_stream():
            self._adamw()

    def step(self, inputs, targets, lr: float | None = None) -> None:
        """One training step (forward, backward, clipping, AdamW), queued without a host sync.

        The first step runs kernel by kernel; it compiles the kernels and lets cuBLAS choose its
        algorithms. The second is captured into a CUDA graph (`graph=True`), and from then on a step is
        the copy of the batch and of AdamW's per-step values into the engine's buffers, and one launch of
        that graph: the GPU runs the step's ~500 kernels back to back, without a launch gap between them."""
        self._load_batch(inputs, targets)
        self._set_hyper(self.lr if lr is None else float(lr))
        with self._on_stream():
            if self._graph is None and self.graph and self._eager_steps:
                self._graph = self._capture()
            if self._graph is not None:
                self._graph.launch(self.stream)
            else:
                self._forward_backward()
                self._adamw()
                self._eager_steps += 1

    def _capture(self):
        """The whole step as a CUDA graph, or None (with a warning) where capture fails."""
        try:
            self.stream.begin_capture()
            try:
                self._forward_backward()
                self._adamw()
            finally:
                graph = self.stream.end_capture()
            return graph
        except Exception as exc:  # e.g. a CuPy or driver without stream capture: run kernel by kernel
            warnings.warn(f"capturing the training step into a CUDA graph failed ({type(exc).__name__}: {exc}); "
                          "running it kernel by kernel", RuntimeWarning, stacklevel=3)
            self.graph = False
            return None

    def _set_hyper(self, lr: float) -> None:
        """Count the step and queue AdamW's values for it (step size, 1/sqrt(1 - b2^t), decay factor) on
        the current stream; the copy from pageable memory is staged at once, so the host never waits."""
        self.t += 1
        self._hyper_host[:] = (lr / (1.0 - self.beta1 ** self.t), 1.0 / math.sqrt(1.0 - self.beta2 ** self.t),
                               1.0 - lr * self.weight_decay)
        cp.cuda.runtime.memcpyAsync(self.hyper.data.ptr, self._hyper_host.ctypes.data, self._hyper_host.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, cp.cuda.get_current_stream().ptr)

    def _forward_backward(self) -> None:
        cfg = self.cfg
        L, C, H, Hkv, D, F, V, K = (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden,
                                    cfg.vocab_size, cfg.mtp_heads)
        B, T, N = self.B, self.T, self.N
        HD = H * D
        warp_rows = (-(-N // 8),)  # grid of a warp per row, 8 rows a block: the embedding, the RMSNorm backward
        k = self._k
        gemm = self.gemm
        i32, i64, f32 = np.int32, np.int64, np.float32
        stream = cp.cuda.get_current_stream().ptr
        # Every gradient is overwritten by the step (GEMMs with beta=0, the first output-head chunk included,
        # and the norm gains' column sums) except the embedding's, which the backward scatters into
        # with atomics: only it is zeroed (the padding between tensors stays zero from __init__).
        cp.cuda.runtime.memsetAsync(self.demb.data.ptr, 0, self.demb.nbytes, stream)
        cp.cuda.runtime.memsetAsync(self.sq.data.ptr, 0, 4, stream)
        k["ce_head_scale"]((1,), (1024,), (self.tg, self.head_scale, i64(N), i32(K)))
        k["embed_fwd"](warp_rows, (256,), (self.ids, self.emb, self.xs[0], i32(C), i32(N)))
        G, rows = _FLASH[D]
        scale = f32(1.0 / math.sqrt(D))
        qs = (i64(H * T * D), i64(T * D), i64(D))
        ks = (i64(Hkv * T * D), i64(T * D), i64(D))
        das = (i64(T * HD), i64(D), i64(HD))
        dims = (i32(H), i32(Hkv), i32(T), i32(T), scale)
        pairs = N * (H + 2 * Hkv) * (D // 2)
        nqb = -(-T // 64)  # 64-row tiles of the tensor-core attention
        row_grid = (-(-((H + 2 * Hkv) * (D // 2)) // 256), min(N, 65535))  # per-row kernels: x columns, y rows
        split_grid = _grid(N * (H + 2 * Hkv) * (D // 16))  # qkv_rope_split_bf16: 8 pairs per thread
        glu_grid = (-(-F // (256 * (8 if F % 8 == 0 else 2))), min(N, 4096))
        mdims = (i32(H), i32(Hkv), i32(T), scale)
        norm_grid = ((N + 3) // 4,)
        eps = f32(cfg.norm_eps)
        xs, ob, ybr = self.xs, self.ob, self.ybr

        def norm(x, xhat, rstd, add=(), out=None):
            """xhat = bf16((x + the bf16 branches in `add`) * rstd) and rstd; the sum also into `out`."""
            y, y2 = (tuple(add) + (x, x))[:2]  # unread placeholders where fewer than two branches
            k["rmsnorm_fwd_bf16"](norm_grid, (128,), (x, y, y2, xhat, rstd, x if out is None else out, i32(N),
                                                      i32(C), eps, i32(len(add)), i32(out is not None)))

        # The residual stream: x_in = xs[i % 2]; x_mid = x_in + ob (the o_proj branch, bf16; x_mid itself
        # is never stored); x_out = x_mid + ybr (the down branch), stored into xs[(i + 1) % 2] by the next
        # layer's first norm, which adds both branches in.
        for i in range(L):
            w = self.Lw[i]
            if i == 0:
                norm(xs[0], self.xh1[0], self.rstd1[0])
            else:  # x_in = x_in of the previous layer + its o_proj branch + its MLP branch
                norm(xs[(i - 1) % 2], self.xh1[i], self.rstd1[i], add=(ob, ybr), out=xs[i % 2])
            if self.fuse_rope:  # q/k/v, rotated, straight from the product's registers
                run_qkv_rope_gemm(self._qkv_rope_gemm, self.xh1_maps[i], self.wqkv_maps[i], *self.qkv_maps[i],
                                  self.cos, self.sin, N, C, T, H, Hkv, self.sms)
            else:
                gemm(self.mqkv, self.mxh1[i], w["qkv"], tb=True)
            if self.attention != "fp32":
                if not self.fuse_rope:
                    k["qkv_rope_split_bf16"](split_grid, (256,), (self.qkv, self.cos, self.sin, self.q[i], self.k[i],
                                                                  self.v[i], i32(T), i32(H), i32(Hkv), i32(D), i32(N)))
                self._mma["flash_fwd"]((B * H, nqb), (128,), (self.q[i], self.k[i], self.v[i], self.a[i],
                                                                 self.lse[i], i32(H), i32(Hkv), i32(T), scale))
            else:
                k["qkv_rope_split"](_grid(pairs), (256,), (self.qkv, self.cos, self.sin, self.q[i], self.k[i], self.v[i],
                                                           i32(T), i32(H), i32(Hkv), i32(D), i64(pairs)))
                self._flash["flash_fwd"]((-(-T // rows), B * H), (rows * G,),
                                         (self.q[i], *qs, self.k[i], *ks, self.v[i], *ks, self.att, self.lse[i], *dims))
                k["attn_pack"](_grid(N * HD), (256,), (self.att, self.a[i], i32(T), i32(H), i32(D), i64(N * HD)))
            gemm(self.mob, self.ma[i], w["o"], tb=True)
            norm(xs[i % 2], self.xh2[i], self.rstd2[i], add=(ob,))  # of x_mid
            if self.fuse_swiglu:  # gate/up and m = silu(gate) * up in one kernel
                run_swiglu_fwd_gemm(self._swiglu_fwd_gemm, self.xh2_maps[i], self.wgu_maps[i], self.gu_maps[i],
                                    self.m_map, N, C, F, self.sms)
            else:
                gemm(self.mgu[i], self.mxh2[i], w["gu"], tb=True)
                k["swiglu_fwd_bf16"](glu_grid, (256,), (self.gu[i], self.m, i32(F), i32(N)))
            gemm(self.mybr, self.mm, w["d"], tb=True)

        norm(xs[(L - 1) % 2], self.xn, self.rstdf, add=(ob, ybr))  # the trunk's output, normed
        # output heads, one head and one chunk of R rows at a time: logits (R, V) never exist for all rows.
        # Per head rather than all K heads at once: the weight gradient that each chunk's GEMM reads and
        # writes back in float32 is then one head's (V, C), not (K*V, C), for the same arithmetic.
        R = self.R
        for r0 in range(0, N, R):
            r1 = min(N, r0 + R)
            rr = r1 - r0
            lg = Matrix(self.logits[:rr])  # the logits, then (in place) their gradient
            xc = Matrix(self.xn[r0:r1])
            dxc = Matrix(self.dxn[r0:r1])
            for h, (wh, dwh) in enumerate(zip(self.w_head, self.dw_head)):
                gemm(lg, xc, wh, tb=True)
                k["ce_heads_fwd_bwd"]((rr,), (256,), (lg.arr, self.tg[r0:r1], self.head_scale,
                                                      self.loss_rows[r0:r1], i32(V), i32(K), i32(h)))
                gemm(dxc, lg, wh, beta=0.0 if h == 0 else 1.0)
                gemm(dwh, lg, xc, ta=True, beta=0.0 if r0 == 0 else 1.0)
        k["ce_loss_reduce"]((1,), (1024,), (self.loss_rows, self.head_scale, self.loss, i64(N), i32(K)))

        fold_cols = gain_fold_columns(C)

        def fold(wmat, dwmat, gain, dgain, rows):
            """dW' (the folded image's weight gradient, in G) -> dW = dW' * gain in place, and the gain's
            gradient = column sums of W * dW'; their squares into the gradient norm."""
            splits, per_split = gain_fold_splits(rows)
            k["gain_fold_grad"]((-(-C // fold_cols), splits), (256,), (wmat, dwmat, gain, self.gpart, i32(rows),
                                                                       i32(C), i32(per_split), self.sq))
            k["column_sums"]((-(-C // 32),), (32, 32), (self.gpart, dgain, i32(splits), i32(C)))

        fold(*self.fold_heads)
        # dL/dxhat of the final norm (dxn, float32: summed over the heads) -> dx of the trunk's output
        k["rmsnorm_bwd_bf16_f32dy"](warp_rows, (256,), (self.dxn, self.xn, self.rstdf, self.dx, self.dxb, i32(N),
                                                         i32(C), i32(0)))
        for i in reversed(range(L)):
            w = self.Lw[i]
            # MLP half: x_out = x_mid + down(silu(gate(h2)) * up(h2)); the SwiGLU backward also recomputes
            # m = silu(gate) * up, which the down projection's weight gradient then reads. Fused: dm = dy Wd
            # and the SwiGLU backward in one kernel, dm never stored.
            if self.fuse_swiglu:
                run_swiglu_bwd_gemm(self._swiglu_bwd_gemm, self.dy_map, self.wdt_map, i * F, self.gu_maps[i],
                                    self.dgu_map, self.m_map, N, C, F, self.sms)
            else:
                gemm(self.mdm, self.mdxb, w["d"])
                k["swiglu_bwd_bf16"](glu_grid, (256,), (self.dm, self.gu[i], self.dgu, self.m, i32(F), i32(N)))
            gemm(w["dd"], self.mdxb, self.mm, ta=True)
            # gate/up read xhat2 = norm2(x_mid) through weights with the norm's gain folded in: the GEMM
            # gives dL/dxhat2, the norm's backward needs only xhat2 and rstd2
            gemm(self.mdh, self.mdgu, w["gu"])
            k["rmsnorm_bwd_bf16"](warp_rows, (256,), (self.dh, self.xh2[i], self.rstd2[i], self.dx, self.dxb,
                                                      i32(N), i32(C), i32(1)))
            gemm(w["dgu"], self.mdgu, self.mxh2[i], ta=True)
            fold(*w["fold_gu"])
            # attention half: x_mid = x_in + o(attn(rope(q(h1)), rope(k(h1)), v(h1)))
            gemm(w["do"], self.mdxb, self.ma[i], ta=True)
            gemm(self.mda, self.mdxb, w["o"])
            if self.attention != "fp32":
                # the dq kernel also computes delta = rowsum(dO * O), which the dk/dv kernel then reads
                rope = (self.dqkv, self.cos, self.sin, *mdims)
                self._mma["flash_bwd_dq"]((B * H, nqb), (128,), (self.q[i], self.k[i], self.v[i], self.da, self.a[i],
                                                                 self.lse[i], self.delta, *rope))
                self._mma["flash_bwd_dkdv"]((B * Hkv, nqb), (128,), (self.q[i], self.k[i], self.v[i], self.da,
                                                                     self.lse[i], self.delta, *rope))
            else:
                k["attn_delta"]((-(-(N * H) // 8),), (256,), (self.a[i], self.da, self.delta, i32(T), i32(H), i32(D),
                                                               i64(N * H)))
                qkv = (self.q[i], *qs, self.k[i], *ks, self.v[i], *ks)
                self._flash["flash_bwd_dkdv"]((-(-T // rows), B * Hkv), (rows * G,),
                                              (*qkv, self.da, *das, self.lse[i], self.delta, self.dk, self.dv, *dims))
                self._flash["flash_bwd_dq"]((-(-T // rows), B * H), (rows * G,),
                                            (*qkv, self.da, *das, self.lse[i], self.delta, self.att, *dims))
                k["rope_bwd_pack"](row_grid, (256,), (self.att, self.dk, self.dv, self.cos, self.sin, self.dqkv,
                                                      i32(T), i32(H), i32(Hkv), i32(D), i32(N)))
            # the same for qkv and xhat1 = norm1(x_in)
            gemm(self.mdh, self.mdqkv, w["qkv"])
            k["rmsnorm_bwd_bf16"](warp_rows, (256,), (self.dh, self.xh1[i], self.rstd1[i], self.dx, self.dxb,
                                                      i32(N), i32(C), i32(1)))
            gemm(w["dqkv"], self.mdqkv, self.mxh1[i], ta=True)
            fold(*w["fold_qkv"])
        k["embed_bwd"](warp_rows, (256,), (self.dx, self.ids, self.demb, i32(C), i32(N)))
        # the gradient norm: the folded matrices added their squares already; the rest lie before them
        n = self.fold_start
        k["sumsq"]((min(4096, -(-n // 256)),), (256,), (self.G, i64(n), self.sq))

    def _adamw(self) -> None:
        f32 = np.float32
        for start, end, decayed, gain, cols in self.runs:  # every gain before the images that fold it in
            n = end - start
            self._k["adamw_clip_bf16"](
                (min(4096, -(-n // 256)),), (256,),
                (self.P[start:end], self.G[start:end], self.Mo[start:end], self.Vo[start:end], self.Pb[start:end],
                 np.int64(n), self.sq, self.hyper, np.int32(decayed), f32(self.max_norm), f32(self.beta1),
                 f32(self.beta2), f32(self.eps), gain, np.int32(cols)))
        self._refresh_wdt()

    def _refresh_wdt(self) -> None:
        """`swiglu_bwd_gemm`'s image of every layer's Wd, from the bf16 image (nothing when not fused)."""
        if self.fuse_swiglu:
            C, F, L = self.cfg.dim, self.cfg.hidden, self.cfg.n_layers
            self._k["wdt_image"]((-(-F // 32), -(-C // 32), L), (32, 8), (self.Pb, self.wd_offsets, self.wdt,
                                                                              np.int32(C), np.int32(F)))
