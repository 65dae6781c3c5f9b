"""The bf16 engine's host-side arithmetic, without a GPU: which kernel variants run, where every tensor
lies in the flat buffers, and the grids and chunk sizes that depend only on shapes.

    >>> from nanoeuler.model.config import ModelConfig
    >>> cfg = ModelConfig.named("gpu")
    >>> choose_variants(cfg, seq=512, sm90a=True)
    Variants(attention='wg', fuse_swiglu=True, fuse_rope=True)
    >>> choose_variants(cfg, seq=512, sm90a=False)
    Variants(attention='ldm', fuse_swiglu=False, fuse_rope=False)
    >>> layout = plan_layout(cfg)
    >>> layout.total >= cfg.n_params(), layout.runs[-1].gain
    (True, 'norm.weight')
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanoeuler.optim import GROUPS, default_no_decay, param_group

BF16_STORAGE = np.uint16  # bf16 values travel as raw 16-bit words; the kernels convert them
ALIGN = 64  # elements: every tensor of the flat buffers starts 256-byte aligned (float32)
FLASH = {16: (1, 128), 32: (1, 128), 64: (2, 64), 128: (4, 32)}  # float32 attention.cu: (lanes a row, rows a block)
MMA_HEAD_DIMS = (32, 64)  # the tensor-core attention of flash_mma.cu / flash_wg.cu
ATTENTION_VARIANTS = ("wg", "ldm", "mma", "fp32")
FOLD_SPLITS = 64  # row splits of gain_fold_grad at most (its column sums are reduced by column_sums)


# ---- variants ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variants:
    attention: str  # "wg" (wgmma, sm_90a), "ldm" (ldmatrix), "mma" (32-bit loads) or "fp32" (attention.cu)
    fuse_swiglu: bool  # the SwiGLU inside the gate/up and down GEMMs (gemm_tma.cu)
    fuse_rope: bool  # RoPE and the attention layouts inside the qkv GEMM (gemm_tma.cu)


def choose_variants(
    cfg,
    seq: int,
    attention: str = "auto",
    fuse_swiglu: bool | None = None,
    fuse_rope: bool | None = None,
    *,
    sm90a: bool,
) -> Variants:
    """The engine's kernel variants for a model, sequence length and GPU (`sm90a`: compute capability 9.0).
    "auto" / None pick the fastest that applies; an explicit choice that does not apply is a ValueError."""
    D = cfg.head_dim
    if D not in FLASH:
        raise ValueError(f"head_dim {D} not supported by the attention kernels ({sorted(FLASH)})")
    if attention == "auto":
        attention = "wg" if D == 64 and sm90a else "ldm" if D in MMA_HEAD_DIMS else "fp32"
    if (
        attention not in ATTENTION_VARIANTS
        or (attention != "fp32" and D not in MMA_HEAD_DIMS)
        or (attention == "wg" and (D != 64 or not sm90a))
    ):
        raise ValueError(
            f"attention {attention!r} for head_dim {D}"
            + (" (needs head_dim 64 on a compute-capability-9.0 GPU)" if attention == "wg" else "")
        )
    swiglu_ok = cfg.dim % 64 == 0 and cfg.hidden % 128 == 0 and sm90a
    if fuse_swiglu and not swiglu_ok:
        raise ValueError(
            f"fuse_swiglu needs dim % 64 == 0 and hidden % 128 == 0 on a compute-capability-9.0 "
            f"GPU (dim {cfg.dim}, hidden {cfg.hidden})"
        )
    rope_ok = D == 64 and cfg.dim % 64 == 0 and seq % 64 == 0 and attention != "fp32" and sm90a
    if fuse_rope and not rope_ok:
        raise ValueError(
            f"fuse_rope needs head_dim 64, dim % 64 == 0, seq % 64 == 0 and bf16 attention on a "
            f"compute-capability-9.0 GPU (head_dim {D}, dim {cfg.dim}, seq {seq}, "
            f"attention {attention!r})"
        )
    return Variants(
        attention,
        swiglu_ok if fuse_swiglu is None else bool(fuse_swiglu),
        rope_ok if fuse_rope is None else bool(fuse_rope),
    )


# ---- the flat parameter layout ------------------------------------------------------------------------


@dataclass
class Run:
    """A range of the flat buffers that one AdamW launch updates: equally decayed, of one learning-rate
    group (`optim.param_group`), and (gain set) one matrix of `cols` columns whose GEMM image carries that
    norm gain. `region`: the ZeRO-1 rank whose region holds it."""

    start: int
    end: int
    decayed: bool
    gain: str | None
    cols: int
    group: str = "hidden"
    region: int = 0


@dataclass
class Layout:
    shapes: dict  # name -> shape, ModelConfig.param_shapes()
    offsets: dict = field(default_factory=dict)  # name -> first element in the flat buffers
    group_of: dict = field(default_factory=dict)  # name -> (start, end) of the stacked matrix it belongs to
    gain_of: dict = field(default_factory=dict)  # matrix name -> the norm gain folded into its GEMM image
    runs: list = field(default_factory=list)
    total: int = 0  # elements, padding included: shards * span
    fold_start: int | None = 0  # the gain-folded matrices lie from here to the end (None when sharded)
    shards: int = 1  # ZeRO-1's ranks: region r is [r * span, (r + 1) * span)
    span: int = 0
    region_of: dict = field(default_factory=dict)  # name -> the region that holds it

    def cols(self, name: str) -> int:
        s = self.shapes[name]
        return s[-1] if len(s) > 1 else 1

    def region(self, r: int) -> tuple[int, int]:
        return r * self.span, (r + 1) * self.span


def gemm_groups(cfg) -> list:
    """[(tensor names read by one GEMM as one stacked matrix, the norm gain folded into it or None)]."""
    groups = [(["embed_tokens.weight"], None)]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        groups += [([p + "input_layernorm.weight"], None), ([p + "post_attention_layernorm.weight"], None)]
    groups.append((["norm.weight"], None))
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        groups += [
            (
                [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                p + "input_layernorm.weight",
            ),
            ([p + "self_attn.o_proj.weight"], None),
            ([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "post_attention_layernorm.weight"),
            ([p + "mlp.down_proj.weight"], None),
        ]
    groups.append((["lm_head.weight"] + [f"mtp_heads.{k}.weight" for k in range(1, cfg.mtp_heads)], "norm.weight"))
    return groups


def _unit_of(name: str) -> int:
    """What ZeRO-1 keeps together, in order: the embedding (0), layer i (i + 1), the final norm and the
    output heads (-1)."""
    if name.startswith("embed_tokens."):
        return 0
    if name.startswith("layers."):
        return int(name.split(".")[1]) + 1
    return -1


def _group_size(shapes: dict, names: list) -> int:
    return -(-sum(int(np.prod(shapes[n])) for n in names) // ALIGN) * ALIGN


def balance(sizes: list, parts: int) -> list:
    """Cut `sizes` (in order) into `parts` contiguous runs whose largest sum is the least possible, the
    first and the last run never empty (they hold the embedding and the output heads): the index where
    each run starts, then len(sizes). Ties go to the earliest cut.

        >>> balance([3, 5, 5, 5, 2], 2)                  # 3+5 | 5+5+2: the largest is 12
        [0, 2, 5]
        >>> balance([4, 1, 4], 3), balance([4, 4], 3)    # more runs than sizes: empty ones in the middle
        ([0, 1, 2, 3], [0, 1, 1, 2])
    """
    n, inf = len(sizes), float("inf")
    at = [0]
    for s in sizes:
        at.append(at[-1] + s)
    # best[k][i]: the least largest sum of sizes[:i] cut into k + 1 runs; start[k][i]: where the last begins
    best, start = [[at[i] if i else inf for i in range(n + 1)]], [[0] * (n + 1)]
    for k in range(1, parts):
        row, where = [], []
        for i in range(n + 1):
            last = range(i + 1) if k < parts - 1 else range(min(i, n - 1) + 1)  # run k: sizes[j:i]
            j = min(last, key=lambda j: (max(best[-1][j], at[i] - at[j]), j))
            row.append(max(best[-1][j], at[i] - at[j]))
            where.append(j)
        best.append(row)
        start.append(where)
    cuts, i = [n], n
    for k in range(parts - 1, 0, -1):
        i = start[k][i]
        cuts.append(i)
    return [0] + cuts[::-1]


def plan_layout(cfg, no_decay=None, shards: int = 1) -> Layout:
    """Every parameter's place in the engine's flat buffers (parameters, gradients, moments, bf16 image).

    The gain-folded matrices come last, so that AdamW updates every gain before the images that fold it
    in and the gradient norm's plain sum covers a prefix; undecayed before decayed (a stable sort).
    Tensors of one group are adjacent (one stacked GEMM operand); each group starts ALIGN-aligned. A run
    holds one learning-rate group (the embedding, the gains, the hidden matrices: separate runs).

    `shards` > 1 (ZeRO-1): region r of `span` elements at r * span is rank r's, whose optimizer state it
    alone keeps. A region holds whole layers (the embedding with the first, the final norm and the heads
    with the last; `balance` picks the layer ranges), each laid out as above, and every region is padded
    to the longest, so that equal chunks of the flat buffers are the regions (NCCL's reduce-scatter and
    all-gather, in place). Here 2 layers on 2 ranks: rank 1 holds layer 1, the final norm and lm_head.

        >>> from nanoeuler.model.config import ModelConfig
        >>> cfg = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=1)
        >>> lay = plan_layout(cfg, shards=2)
        >>> lay.span, lay.total, [lay.region_of[n] for n in ("embed_tokens.weight", "layers.1.mlp.up_proj.weight")]
        (4032, 8064, [0, 1])
        >>> [lay.offsets[n] for n in ("layers.1.input_layernorm.weight", "norm.weight", "lm_head.weight")]
        [4032, 4160, 7040]
    """
    shapes = cfg.param_shapes()
    no_decay = {n for n, s in shapes.items() if default_no_decay(n, s)} if no_decay is None else set(no_decay)
    groups = gemm_groups(cfg)
    units = sorted({_unit_of(names[0]) for names, _ in groups}, key=lambda u: (u < 0, u))
    sizes = {u: 0 for u in units}
    for names, _ in groups:
        sizes[_unit_of(names[0])] += _group_size(shapes, names)
    cuts = balance([sizes[u] for u in units], shards)
    region = {u: r for r in range(shards) for u in units[cuts[r] : cuts[r + 1]]}
    span = max(sum(sizes[u] for u in units[cuts[r] : cuts[r + 1]]) for r in range(shards))
    lay = Layout(shapes, shards=shards, span=span, total=shards * span)
    for r in range(shards):
        _lay_out(lay, [g for g in groups if region[_unit_of(g[0][0])] == r], no_decay, r * span, r)
    if set(lay.offsets) != set(shapes):
        raise ValueError("flat layout does not cover the parameters")
    if shards == 1:
        lay.fold_start = min((r.start for r in lay.runs if r.gain is not None), default=lay.total)
    else:
        lay.fold_start = None
    return lay


def _lay_out(lay: Layout, groups: list, no_decay: set, off: int, region: int) -> None:
    """`groups` from element `off` on, in `plan_layout`'s order, as region `region`'s tensors and runs."""
    shapes = lay.shapes
    groups = sorted(groups, key=lambda g: (g[1] is not None, g[0][0] not in no_decay))
    first_run = len(lay.runs)
    for names, gain in groups:
        decayed = {n not in no_decay for n in names}
        kinds = {param_group(n) for n in names}
        if len(decayed) != 1 or len(kinds) != 1:
            raise ValueError(f"tensors {names} are read by one GEMM but differ in weight decay or group")
        d, kind = decayed.pop(), kinds.pop()
        start = off
        for n in names:
            lay.offsets[n] = off
            lay.region_of[n] = region
            off += int(np.prod(shapes[n]))
            if gain is not None:
                lay.gain_of[n] = gain
        for n in names:
            lay.group_of[n] = (start, off)
        if gain is not None and off - start >= 2**31:
            raise ValueError(f"tensors {names} exceed the 32-bit indexing of the gain-folding kernels")
        end = -(-off // ALIGN) * ALIGN
        last = lay.runs[-1] if len(lay.runs) > first_run else None
        if (
            gain is None
            and last is not None
            and last.decayed == d
            and last.gain is None
            and last.end == start
            and last.group == kind
        ):
            last.end = end
        else:
            lay.runs.append(Run(start, end, d, gain, shapes[names[0]][-1], kind, region))
        off = end


# ---- scratch and chunks -------------------------------------------------------------------------------


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
    32 rows, at most FOLD_SPLITS of them (their column sums are then added by `column_sums`).

        >>> gain_fold_splits(1280), gain_fold_splits(16384), gain_fold_splits(37)
        ((40, 32), (64, 256), (2, 19))
    """
    splits = min(FOLD_SPLITS, -(-rows // 32))
    return splits, -(-rows // splits)


def gain_fold_columns(C: int) -> int:
    """Columns per block of `gain_fold_grad`: 4 per lane (16-byte accesses) when C is a multiple of 4."""
    return 128 if C % 4 == 0 else 32


# ---- the fused GEMMs' tiling --------------------------------------------------------------------------


def sg_row(j: int) -> int:
    """Row of a 128-row block of `wdt_image` that holds column j (0..127) of the block (gemm_tma.cu's sg_row):
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


def qkv_rope_gemm_grid(N: int, heads: int, sms: int) -> tuple:
    """Grid of `qkv_rope_gemm`: a block per multiprocessor, at most one per tile of 128 rows x 2 heads.

    >>> qkv_rope_gemm_grid(32768, 20, sms=132), qkv_rope_gemm_grid(192, 7, sms=132)
    ((132,), (8,))
    """
    return (min(sms, -(-N // 128) * -(-heads // 2)),)


def swiglu_gemm_grid(N: int, F: int, sms: int, tile_units: int = 128) -> tuple:
    """Grid of a persistent fused SwiGLU kernel: a block per multiprocessor, at most one per tile of 128 rows
    x `tile_units` hidden units (128 in the backward, 64 in the forward).

        >>> swiglu_gemm_grid(32768, 2048, sms=132), swiglu_gemm_grid(300, 1024, sms=132)
        ((132,), (24,))
        >>> swiglu_gemm_grid(300, 1024, sms=132, tile_units=64)
        (48,)
    """
    return (min(sms, -(-N // 128) * (F // tile_units)),)


# ---- memory -------------------------------------------------------------------------------------------

TENSOR_MAP_BYTES = 128  # a TMA descriptor, kept on the device


def engine_bytes(
    cfg,
    batch: int,
    seq: int,
    *,
    attention: str,
    fuse_swiglu: bool,
    fuse_rope: bool,
    accum: bool = False,
    checkpoint: bool = False,
    head: str = "ce",
    chunk_bytes: int | None = None,
    shards: int = 1,
) -> dict:
    """Device bytes of every buffer `TrainEngine.__init__` allocates, by group; their sum is `TrainEngine.nbytes()`.

    The variants are resolved ones (`choose_variants`); `batch` counts sequences (DPO: twice the pairs).
    Groups: params / grads / moments (float32 master weights, gradients, both AdamW moments), image (the
    bf16 weights), wdt (the fused SwiGLU backward's Wd image), accumulator (`accum`), activations (what the
    backward keeps: per layer, or with `checkpoint` each layer's input and one layer's worth), arena (MLP
    scratch shared with the output heads' logits), scratch (the rest of the step's buffers and tables).
    `shards`: one rank of ZeRO-1 over that many, whose moments cover its region of the flat buffers only.

        >>> from nanoeuler.model.config import ModelConfig
        >>> cfg = ModelConfig.named("gpu")
        >>> full = engine_bytes(cfg, 16, 512, attention="wg", fuse_swiglu=True, fuse_rope=True)
        >>> ckpt = engine_bytes(cfg, 16, 512, attention="wg", fuse_swiglu=True, fuse_rope=True, checkpoint=True)
        >>> ckpt["activations"] < full["activations"] / 3, ckpt["params"] == full["params"]
        (True, True)
        >>> zero4 = engine_bytes(cfg, 16, 512, attention="wg", fuse_swiglu=True, fuse_rope=True, shards=4)
        >>> round(zero4["moments"] / full["moments"], 2), round(zero4["params"] / full["params"], 3)
        (0.27, 1.081)
    """
    if attention not in ATTENTION_VARIANTS or head not in ("ce", "dpo"):
        raise ValueError(f"attention {attention!r} (one of {ATTENTION_VARIANTS}), head {head!r} ('ce' or 'dpo')")
    B, T = int(batch), int(seq)
    N = B * T
    L, C, H, Hkv, D, F, V, K = cfg.letters
    lay = plan_layout(cfg, shards=shards)
    n = lay.total
    bf, f4 = 2, 4
    qb = bf if attention != "fp32" else f4  # the attention operands' element size
    keep = 1 if checkpoint else L  # layers whose activations exist at once
    per_layer = (
        2 * N * C * bf
        + 2 * N * f4
        + (B * H * T * D + 2 * B * Hkv * T * D) * qb
        + B * H * T * f4
        + N * H * D * bf
        + N * 2 * F * bf
    )  # xhat1, xhat2, 1/rms x2, q, k, v, lse, a, gate/up
    stream = (L if checkpoint else 2) * N * C * f4  # the residual stream's buffers
    _, mlp_bytes = carve(mlp_scratch(N, F, fuse_swiglu))
    R = head_chunk_rows(N, V, mlp_bytes, chunk_bytes)
    scratch = (
        2 * N * C * bf  # the o_proj and down branches
        + N * (H + 2 * Hkv) * D * bf  # qkv (forward) / dqkv (backward)
        + (B * H * T * D + 2 * B * Hkv * T * D) * f4 * (attention == "fp32")  # float32 attention's out, dk, dv
        + N * C * bf
        + N * H * D * qb
        + B * H * T * f4  # dh, da, delta
        + N * C * f4
        + N * C * bf
        + N * C * bf
        + N * f4
        + N * C * f4  # dx, dxb, xn, rstdf, dxn
        + FOLD_SPLITS * C * f4
        + 3 * len(GROUPS) * f4
        + 2 * f4  # gpart, each lr group's values, loss, sq
        + N * f4
        + N * K * f4  # ids, targets
        + 2 * T * (D // 2) * f4
    )  # the RoPE tables
    if head == "ce":
        scratch += N * K * f4 + 2 * K * f4  # per-row losses, head scale, head weights
    else:
        scratch += 2 * N * f4 + 2 * B * f4 + B * f4 + (B // 2) * f4  # tok, lse rows; logp, dlogp; ref; pair weights
    maps = 0
    if fuse_swiglu:
        maps += 4 + 2 * keep + L  # dy, wdt, m, dgu; xhat2 and gu per kept layer; Wgu per layer
    if fuse_rope:
        maps += 4 * keep + L  # xhat1, q, k, v per kept layer; Wqkv per layer
    scratch += maps * TENSOR_MAP_BYTES
    return {
        "params": n * f4,
        "grads": n * f4,
        "moments": 2 * lay.span * f4,
        "image": n * bf,
        "wdt": (L * F * C * bf + L * 8) if fuse_swiglu else 0,
        "accumulator": (n * f4 + f4) if accum else 0,
        "activations": keep * per_layer + stream,
        "arena": max(mlp_bytes, 2 * R * V),
        "scratch": scratch,
    }
