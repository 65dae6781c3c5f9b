"""The whole training step on the GPU in mixed precision: bf16 GEMM operands, float32 everything else.

    >>> eng = TrainEngine(cfg, params, batch=16, seq=512)       # params: NumPy or CuPy float32   # doctest: +SKIP
    >>> eng.step(inputs, targets, lr)   # forward, backward, clipping, AdamW; no host sync        # doctest: +SKIP
    >>> eng.last_loss()                 # reads the loss back (a sync; call it when logging)      # doctest: +SKIP
    >>> eng = TrainEngine(cfg, params, batch=4, seq=512, accum=True, checkpoint=True)            # doctest: +SKIP
    >>> eng.step_accum([(x0, y0), (x1, y1)], lr)   # one update from two micro-batches            # doctest: +SKIP

ZeRO-1 (`shards`, `rank`, then `set_zero(comm)`): every rank keeps the whole master weights, gradients
and bf16 image, but the optimizer's moments of its own region of the flat buffers only; a step
reduce-scatters the gradients, updates the region and all-gathers the master weights (`_zero_update`).

Options: `accum` (an accumulation buffer, so that `step_accum` makes one update from several micro-batches
of the engine's shape), `checkpoint` (keep each layer's input only and recompute the layer in the
backward), `head="dpo"` (head 0's sequence log-probabilities and DPO's pair loss instead of the
multi-token cross-entropy; `model.dpo.dpo_head_loss` is its reference).

Same model and loss as `transformer.loss_and_grads` followed by `optim.clip_grad_norm` and
`optim.AdamW.step`, and laid out like it: `block_forward(i)` / `block_backward(i)` mirror
`transformer._block_forward` / `_block_backward`, `heads_loss` mirrors `transformer.mtp_cross_entropy`.
Each line is a named launcher of a kernel family (`nanoeuler.kernels.bf16`) or a cuBLAS GEMM
(`cublas.py`). Every buffer is allocated once, at the flat layout that `bf16.plan.plan_layout` computes;
a step allocates nothing and never waits for the device, and from its second call on is replayed as
one CUDA graph. docs/ARCHITECTURE.md ("The bf16 engine") explains the precision, the norm gains folded
into the weights, the memory plan and the fused kernels.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import cupy as cp
import numpy as np

from nanoeuler.kernels import has_sm90a
from nanoeuler.kernels.bf16 import embed, flash, heads, norms, optim, rope, swiglu
from nanoeuler.kernels.bf16.gemm_tma import (
    fused_gemm,
    run_qkv_rope_gemm,
    run_swiglu_bwd_gemm,
    run_swiglu_fwd_gemm,
    wdt_image,
)
from nanoeuler.kernels.bf16.plan import (
    BF16_STORAGE,
    FOLD_SPLITS,
    carve,
    choose_variants,
    head_chunk_rows,
    mlp_scratch,
    plan_layout,
)
from nanoeuler.kernels.cublas import Gemm, Matrix
from nanoeuler.kernels.tma import gate_up_map, heads_map, tile_map
from nanoeuler.model import layers
from nanoeuler.model.config import ModelConfig
from nanoeuler.optim import GROUPS, HIDDEN_MATRICES, NS_COEFFS, NS_STEPS, muon_scale, param_group

_NULL = np.uint64(0)  # a null pointer argument (an optional input or output a kernel skips)


@dataclass
class MuonShape:
    """One hidden matrix (`name`, rows x cols) in every layer the engine updates (all, or under ZeRO-1 its
    region's `layers`): the l-th's at start + l * stride in the flat buffers, its gain (if folded) at
    gain + l * gstride, its Newton-Schulz operands x and y (bf16, the l-th's at l * 2 stride)."""

    name: str
    layers: int
    start: int
    stride: int
    rows: int
    cols: int
    decayed: bool
    scale: float
    gain: object
    gstride: int
    x: object
    y: object


def _group_scales(shapes: dict, lr_scale: dict | None) -> dict:
    """{lr group: multiple of the step's lr} from per-tensor multiples, which must agree within a group."""
    out = {g: set() for g in GROUPS}
    for n in shapes:
        out[param_group(n)].add(float((lr_scale or {}).get(n, 1.0)))
    if any(len(v) > 1 for v in out.values()):
        raise ValueError(f"the engine takes one lr multiple per group {GROUPS}, got {out}")
    return {g: (v.pop() if v else 1.0) for g, v in out.items()}


class TrainEngine:
    """One model's weights, optimizer state and activation buffers on the GPU, for a fixed (batch, seq)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        *,
        batch: int,
        seq: int,
        lr: float = 3e-4,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        max_norm: float = 1.0,
        no_decay=None,
        chunk_bytes: int | None = None,
        attention: str = "auto",
        graph: bool = True,
        fuse_swiglu: bool | None = None,
        fuse_rope: bool | None = None,
        accum: bool = False,
        checkpoint: bool = False,
        head: str = "ce",
        dpo_beta: float = 0.1,
        dpo_label_smoothing: float = 0.0,
        optimizer: str = "adamw",
        muon_momentum: float = 0.95,
        lr_scale: dict | None = None,
        shards: int = 1,
        rank: int = 0,
    ):
        self.cfg = cfg
        self.B, self.T = int(batch), int(seq)
        self.N = self.B * self.T
        if head not in ("ce", "dpo") or (head == "dpo" and self.B % 2):
            raise ValueError(f"head {head!r} with batch {self.B}: 'ce', or 'dpo' with an even batch (pairs)")
        self.accum, self.checkpoint, self.head = bool(accum), bool(checkpoint), head
        self.dpo_beta, self.dpo_eps = float(dpo_beta), float(dpo_label_smoothing)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay, self.max_norm = float(eps), float(weight_decay), float(max_norm)
        self.lr = float(lr)
        self.t = 0
        if optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer {optimizer!r}: 'adamw' or 'muon'")
        self.optimizer, self.muon_momentum = optimizer, float(muon_momentum)
        self.group_scale = _group_scales(cfg.param_shapes(), lr_scale)
        variants = choose_variants(cfg, self.T, attention, fuse_swiglu, fuse_rope, sm90a=has_sm90a())
        self.attention, self.fuse_swiglu, self.fuse_rope = variants.attention, variants.fuse_swiglu, variants.fuse_rope
        if not 0 <= rank < shards:
            raise ValueError(f"rank {rank} of {shards} shards")
        self.layout = plan_layout(cfg, no_decay, shards)
        self.offsets, self.gain_of, self.shapes = self.layout.offsets, self.layout.gain_of, self.layout.shapes
        self.fold_start = self.layout.fold_start
        # ZeRO-1: this rank's region of the flat buffers, the tensors in it, and the transport (`set_zero`)
        self.shards, self.rank = int(shards), int(rank)
        self.base, self.region_end = self.layout.region(self.rank)
        self.owned = [n for n in self.shapes if self.layout.region_of[n] == self.rank]
        self.zero = None
        self.sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self._allocate_parameters(params)
        self._load_kernels()
        # The engine's work runs on a stream of its own (capturable into a CUDA graph; see `step`), ordered
        # against the caller's current stream by events.
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.gemm = Gemm(self.stream)
        self.graph = bool(graph)
        self._graph = None  # the captured step, after one step run kernel by kernel
        self._eager_steps = 0
        self._graphs, self._eager = {}, {}  # the accumulating step's phases ("micro", "update"), likewise
        self._logps = []  # the DPO head's per-sequence log-probs of each micro-batch of the last step (device)
        self.collective = None  # see `set_collective`
        # the optimizer's per-step values of each lr group (GROUPS): AdamW's step size, 1/sqrt(bc2) and decay
        # factor; Muon's group: its lr, -, decay factor
        self.hyper = cp.zeros(3 * len(GROUPS), dtype=np.float32)
        self._hyper_host = np.zeros(3 * len(GROUPS), dtype=np.float32)
        self._refresh_image()
        self._weight_views()
        self._allocate_activations(chunk_bytes)
        self._muon_plan()
        self._tensor_maps()
        cp.cuda.get_current_stream().synchronize()

    # ---- construction ----------------------------------------------------------------------------------

    def _allocate_parameters(self, params: dict) -> None:
        """The flat float32 buffers (master weights, gradients, both moments), the bf16 image, and with the
        fused SwiGLU backward `wdt`, its image of every layer's Wd transposed and permuted (`wdt_image`).
        The moments cover this rank's region only (ZeRO-1; all of it unsharded): element e of the flat
        buffers is element e - base of Mo and Vo."""
        n, f32 = self.layout.total, np.float32
        self.P, self.G = (cp.zeros(n, dtype=f32) for _ in range(2))
        self.Mo, self.Vo = (cp.zeros(self.layout.span, dtype=f32) for _ in range(2))
        self.Pb = cp.zeros(n, dtype=BF16_STORAGE)
        self.Gacc = cp.zeros(n, dtype=f32) if self.accum else None  # the micro-batches' summed gradients
        for name, shape in self.shapes.items():
            src = params[name]
            if tuple(src.shape) != tuple(shape):
                raise ValueError(f"parameter {name} has shape {tuple(src.shape)}, expected {shape}")
            self.view(self.P, name)[...] = cp.asarray(src, dtype=f32)

        def gain(r):  # a run's gain as a device view (AdamW writes the image of a run times its gain)
            return _NULL if r.gain is None else self.view(self.P, r.gain)

        # the AdamW runs of this rank's region, with the index of their lr group; the image's, every region's
        self.runs = [
            (r.start, r.end, r.decayed, gain(r), r.cols, GROUPS.index(r.group))
            for r in self.layout.runs
            if r.region == self.rank
        ]
        self.image_runs = [(r.start, r.end, gain(r), r.cols) for r in self.layout.runs]
        if self.fuse_swiglu:
            cfg = self.cfg
            self.wdt = cp.empty((cfg.n_layers, cfg.hidden, cfg.dim), dtype=BF16_STORAGE)
            self.wd_offsets = cp.asarray(
                [self.offsets[f"layers.{i}.mlp.down_proj.weight"] for i in range(cfg.n_layers)], dtype=np.int64
            )

    def _load_kernels(self) -> None:
        """The kernels chosen by variant; the other families load on their first launch."""
        if self.fuse_swiglu:
            self._swiglu_fwd_gemm = fused_gemm("swiglu_fwd_gemm")
            self._swiglu_bwd_gemm = fused_gemm("swiglu_bwd_gemm")
        if self.fuse_rope:
            self._qkv_rope_gemm = fused_gemm("qkv_rope_gemm")
        self._flash = flash.flash_kernels(self.attention, self.cfg.head_dim)

    def _weight_views(self) -> None:
        """Per layer, the bf16 GEMM operands (the stacked qkv and gate/up matrices, o, down), the float32
        views of their gradients, and what a gain-folded matrix's backward needs (`norms.gain_fold`)."""
        cfg, F, C = self.cfg, self.cfg.hidden, self.cfg.dim
        qkv_rows = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim

        def stacked(flat, first, rows):  # the matrix of `rows` rows starting at tensor `first`
            o, cols = self.offsets[first], self.layout.cols(first)
            return Matrix(flat[o : o + rows * cols].reshape(rows, cols))

        def fold_args(first, gain):  # (W, dW as flat float32 views, the gain, its gradient, rows)
            start, end = self.layout.group_of[first]
            return (
                self.P[start:end],
                self.G[start:end],
                self.view(self.P, gain),
                self.view(self.G, gain),
                (end - start) // self.layout.cols(first),
            )

        self.Lw = []
        for i in range(cfg.n_layers):
            q, o, g, d = (
                f"layers.{i}.{n}.weight"
                for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
            )
            self.Lw.append(
                dict(
                    qkv=stacked(self.Pb, q, qkv_rows),
                    o=stacked(self.Pb, o, C),
                    gu=stacked(self.Pb, g, 2 * F),
                    d=stacked(self.Pb, d, C),
                    dqkv=stacked(self.G, q, qkv_rows),
                    do=stacked(self.G, o, C),
                    dgu=stacked(self.G, g, 2 * F),
                    dd=stacked(self.G, d, C),
                    fold_qkv=fold_args(q, f"layers.{i}.input_layernorm.weight"),
                    fold_gu=fold_args(g, f"layers.{i}.post_attention_layernorm.weight"),
                )
            )
        names = ["lm_head.weight"] + [f"mtp_heads.{h}.weight" for h in range(1, cfg.mtp_heads)]
        self.w_head = [stacked(self.Pb, n, cfg.vocab_size) for n in names]
        self.dw_head = [stacked(self.G, n, cfg.vocab_size) for n in names]
        self.fold_heads = fold_args("lm_head.weight", "norm.weight")
        self.emb = self.view(self.P, "embed_tokens.weight")
        self.demb = self.view(self.G, "embed_tokens.weight")

    def _allocate_activations(self, chunk_bytes: int | None) -> None:
        """What the backward keeps per layer (each norm's xhat as bf16 and 1/rms, q/k/v, the attention output
        and its logsumexp, the gate/up product) and the scratch all layers share. The residual stream lives
        in two buffers that alternate by layer (the backward never reads it); the branches that join it
        (o_proj, down) are bf16 and are added in by the norm that reads the stream next."""
        cfg, N, B, T = self.cfg, self.N, self.B, self.T
        L, C, H, Hkv, D, F, V, K = cfg.letters
        f32, bf = np.float32, BF16_STORAGE

        def e(shape, dt=f32):
            return cp.empty(shape, dtype=dt)

        def per_layer(shape, dt=f32):  # one buffer a layer; checkpointing: one that every layer reuses
            return [e(shape, dt)] * L if self.checkpoint else [e(shape, dt) for _ in range(L)]

        # layer i reads its input from xs[i % len(xs)]: two buffers that alternate, or with checkpointing
        # every layer's input, from which the backward recomputes the layer
        self.xs = [e((N, C)) for _ in range(L if self.checkpoint else 2)]
        self.ob, self.ybr = e((N, C), bf), e((N, C), bf)  # the o_proj and down branches
        self.xh1, self.xh2 = per_layer((N, C), bf), per_layer((N, C), bf)
        self.rstd1, self.rstd2 = per_layer(N), per_layer(N)
        qdt = bf if self.attention != "fp32" else f32  # the attention operands
        self.q = per_layer((B, H, T, D), qdt)
        self.k = per_layer((B, Hkv, T, D), qdt)
        self.v = per_layer((B, Hkv, T, D), qdt)
        self.lse = per_layer((B, H, T))
        self.a = per_layer((N, H * D), bf)
        self.gu = per_layer((N, 2 * F), bf)
        qkv_cols = (H + 2 * Hkv) * D
        self.qkv = self.dqkv = e((N, qkv_cols), bf)  # the qkv GEMM's output forward, its gradient backward
        if self.attention == "fp32":
            self.att = e((B, H, T, D))  # the float32 attention's output (forward) / dq (backward)
            self.dk, self.dv = e((B, Hkv, T, D)), e((B, Hkv, T, D))
        if N * qkv_cols // 16 >= 2**31:
            raise ValueError(f"batch {B} x seq {T} exceeds the 32-bit indexing of the RoPE kernels")
        # The MLP's scratch (m, dm, dgu) is dead while the output heads run, and the heads' chunk of
        # logits (overwritten by their gradient) is dead outside them: both are views of one arena.
        mlp, mlp_bytes = carve(mlp_scratch(N, F, self.fuse_swiglu))
        self.R = head_chunk_rows(N, V, mlp_bytes, chunk_bytes)
        self.arena = cp.empty(max(mlp_bytes, 2 * self.R * V), dtype=np.uint8)
        self.m, self.dgu, *dm = (self.arena[o : o + n].view(dt).reshape(sh) for o, n, sh, dt in mlp)
        self.dm = dm[0] if dm else None
        self.logits = self.arena[: 2 * self.R * V].view(bf).reshape(self.R, V)  # then, in place, their gradient
        self.dh = e((N, C), bf)  # dL/dxhat of a layer's norm (a GEMM's output), into the norm's backward
        self.da = e((N, H * D), qdt)  # gradient of the attention output
        self.delta = e((B, H, T))
        self.dx, self.dxb = e((N, C)), e((N, C), bf)
        self.xn, self.rstdf = e((N, C), bf), e(N)  # xhat of the final norm: the output heads' input
        self.dxn = e((N, C))  # its dL/dxhat, summed over the heads
        self.gpart = e((FOLD_SPLITS, C))  # per-split column sums of gain_fold_grad
        if self.head == "ce":
            self.loss_rows, self.head_scale = e((N, K)), e(K)
            self._scale_host = np.zeros(K, dtype=f32)  # the step's scale, when `accumulate` sets it
            # the heads' loss weights this step: on the device, copied in like AdamW's values (`_set_hyper`)
            self.head_w, self._head_w_host = cp.ones(K, dtype=f32), np.ones(K, dtype=f32)
        else:  # each row's log-prob of its target and logsumexp, each sequence's log-prob, dloss/dlogp
            self.tok, self.lse_rows = e(N), e(N)
            self.logp, self.dlogp = e(B), e(B)
            self.ref, self.pair_w = cp.zeros(B, dtype=f32), cp.zeros(B // 2, dtype=f32)  # loaded with the batch
        self.loss, self.sq = cp.zeros(1, dtype=f32), cp.zeros(1, dtype=f32)
        self.loss_acc = cp.zeros(1, dtype=f32) if self.accum else None
        self.ids, self.tg = cp.zeros(N, dtype=np.int32), cp.zeros((N, K), dtype=np.int32)
        cos, sin = layers.rope_tables(T, D, cfg.rope_theta, cp, np.float32)
        self.cos, self.sin = cp.ascontiguousarray(cos), cp.ascontiguousarray(sin)
        self._matrix_views()

    def _matrix_views(self) -> None:
        """The activations as the GEMMs' `Matrix` operands."""
        self.mxh1, self.mxh2 = [Matrix(x) for x in self.xh1], [Matrix(x) for x in self.xh2]
        self.ma, self.mgu = [Matrix(x) for x in self.a], [Matrix(x) for x in self.gu]
        self.mybr, self.mob = Matrix(self.ybr), Matrix(self.ob)
        self.mqkv, self.mm, self.mdgu = Matrix(self.qkv), Matrix(self.m), Matrix(self.dgu)
        self.mdm = None if self.dm is None else Matrix(self.dm)
        self.mdh, self.mda = Matrix(self.dh), Matrix(self.da)
        self.mdqkv, self.mdxb = Matrix(self.dqkv), Matrix(self.dxb)

    def _tensor_maps(self) -> None:
        """The TMA copies of the fused GEMMs: boxes of 64 columns, 128 rows for the products' operands
        (one map a buffer: with checkpointing, the layers share one)."""

        def maps(make, bufs):
            made = {}
            return [made.setdefault(id(b), make(b)) for b in bufs]

        if self.fuse_swiglu:
            L, F, C = self.cfg.n_layers, self.cfg.hidden, self.cfg.dim
            self.dy_map = tile_map(self.dxb, 128)
            self.wdt_map = tile_map(self.wdt.reshape(L * F, C), 128)
            self.xh2_maps = maps(lambda x: tile_map(x, 128), self.xh2)
            self.wgu_maps = [gate_up_map(w["gu"].arr) for w in self.Lw]  # the bf16 image: rewritten in place
            self.gu_maps = maps(lambda x: tile_map(x, 64), self.gu)  # the epilogues' boxes: 64 rows x 64 columns
            self.m_map = tile_map(self.m, 64)
            self.dgu_map = tile_map(self.dgu, 64)
        if self.fuse_rope:  # xhat1 and Wqkv in boxes of 128 rows; q/k/v, a box per head and 64 positions
            self.xh1_maps = maps(lambda x: tile_map(x, 128), self.xh1)
            self.wqkv_maps = [tile_map(w["qkv"].arr, 128) for w in self.Lw]
            self.q_maps, self.k_maps, self.v_maps = (maps(heads_map, b) for b in (self.q, self.k, self.v))
            self.qkv_maps = list(zip(self.q_maps, self.k_maps, self.v_maps))

    # ---- parameter access ------------------------------------------------------------------------------

    def view(self, flat, name):
        o = self.offsets[name]
        s = self.shapes[name]
        return flat[o : o + int(np.prod(s))].reshape(s)

    def moment(self, flat, name):
        """Tensor `name` of a moment buffer (Mo, Vo: this rank's region, from `base` on)."""
        o = self.offsets[name] - self.base
        s = self.shapes[name]
        return flat[o : o + int(np.prod(s))].reshape(s)

    def region(self, flat):
        """This rank's region of a flat buffer (all of it unsharded)."""
        return flat[self.base : self.region_end]

    def params(self) -> dict:
        """Master weights (float32 views into the engine's buffer; copy before keeping)."""
        return {n: self.view(self.P, n) for n in self.shapes}

    def grads(self, accumulated: bool = False) -> dict:
        """Gradients of the last `forward_backward` (before clipping; views), or (accumulated) the sum over
        the micro-batches of the last `accumulate`."""
        return {n: self.view(self.Gacc if accumulated else self.G, n) for n in self.shapes}

    def state_tensors(self) -> dict:
        """{"m.<name>", "v.<name>"} like `optim.AdamW.state_tensors` (views); the step count is `self.t`.
        Under Muon its hidden matrices have only "m.<name>", the momentum, as `optim.Muon.state_tensors`.
        ZeRO-1: every tensor's, gathered from the ranks (host copies; a collective every rank joins)."""
        if self.shards > 1:
            return self._gathered_state()
        out = {}
        for n in self.shapes:
            out[f"m.{n}"] = self.view(self.Mo, n)
            if not self._muon_owns(n):
                out[f"v.{n}"] = self.view(self.Vo, n)
        return out

    def _gathered_state(self) -> dict:
        """Each moment all-gathered into G, which is dead between steps (a step rewrites what it reads) and
        zeroed after: what the backward leaves unwritten (padding, DPO's heads 1..K-1) must stay zero."""
        if self.zero is None:
            raise ValueError("a sharded engine gathers its optimizer state through its transport (set_zero)")
        out = {}
        for kind, local in (("m", self.Mo), ("v", self.Vo)):
            with self._on_stream():
                self.zero.all_gather(local, self.G)
            host = self.G.get()
            for n in self.shapes:
                if kind == "m" or not self._muon_owns(n):
                    o, shape = self.offsets[n], self.shapes[n]
                    out[f"{kind}.{n}"] = host[o : o + int(np.prod(shape))].reshape(shape)
        with self._on_stream():
            cp.cuda.runtime.memsetAsync(self.G.data.ptr, 0, self.G.nbytes, self.stream.ptr)
        return out

    def _muon_owns(self, name: str) -> bool:
        return self.optimizer == "muon" and param_group(name) == "hidden"

    def load_state(self, params: dict, tensors: dict | None = None, t: int = 0) -> None:
        """Set the master weights (and optionally the AdamW moments and step count), refresh the bf16 image.
        ZeRO-1: `tensors` hold every tensor's moments (a checkpoint of any number of ranks); this rank
        takes its region's."""
        for n in self.shapes:
            self.view(self.P, n)[...] = cp.asarray(params[n], dtype=np.float32)
        for n in self.owned if tensors is not None else ():
            self.moment(self.Mo, n)[...] = cp.asarray(tensors[f"m.{n}"], dtype=np.float32)
            if not self._muon_owns(n):
                self.moment(self.Vo, n)[...] = cp.asarray(tensors[f"v.{n}"], dtype=np.float32)
        self.t = int(t)
        self._refresh_image()

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        """Restore the AdamW moments ({"m.<name>", "v.<name>"}, as `state_tensors` gives) and the step count."""
        self.load_state(self.params(), tensors, t)

    def _refresh_image(self) -> None:
        """The bf16 GEMM image of the master weights, the folded norm gains included."""
        for start, end, gain, cols in self.image_runs:
            optim.f32_to_bf16(self.P[start:end], self.Pb[start:end], gain, cols)
        self._refresh_wdt()

    def refresh_image(self) -> None:
        """`_refresh_image` queued on the engine's stream (after the master weights changed outside a step)."""
        with self._on_stream():
            self._refresh_image()

    def nbytes(self) -> int:
        """Device bytes of the engine's buffers (views into them, such as the arena's, not counted twice)."""
        arrays = []
        for name, v in self.__dict__.items():
            if name != "_logps":  # the last step's log-probs: copies, not the engine's buffers
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

    def last_logps(self) -> np.ndarray:
        """The DPO head's sequence log-probabilities of the last step, (micro-batches, B) (synchronises)."""
        return cp.stack(self._logps).get() if self._logps else np.zeros((0, self.B), dtype=np.float32)

    # ---- the step --------------------------------------------------------------------------------------

    def _load_batch(self, inputs, targets, ref=None, pair_weight=None):
        """The batch into the engine's buffers; with the DPO head also each sequence's reference log-prob
        ref (B,) and each pair's weight in the step's mean (B/2,) (0 for a padding pair)."""
        N, K = self.N, self.cfg.mtp_heads
        if tuple(inputs.shape) != (self.B, self.T) or tuple(targets.shape) != (self.B, self.T, K):
            raise ValueError(
                f"engine built for inputs ({self.B},{self.T}) and targets ({self.B},{self.T},{K}); "
                f"got {tuple(inputs.shape)} and {tuple(targets.shape)}"
            )
        cp.copyto(self.ids, cp.asarray(inputs).reshape(N), casting="unsafe")
        cp.copyto(self.tg, cp.asarray(targets).reshape(N, K), casting="unsafe")
        if self.head == "dpo":
            if ref is None or pair_weight is None or len(ref) != self.B or len(pair_weight) != self.B // 2:
                raise ValueError(
                    f"the DPO head needs ref ({self.B},) and pair weights ({self.B // 2},) with each batch"
                )
            cp.copyto(self.ref, cp.asarray(ref, dtype=np.float32))
            cp.copyto(self.pair_w, cp.asarray(pair_weight, dtype=np.float32))

    @contextlib.contextmanager
    def _on_stream(self):
        """Queue the engine's work on its stream, after what the caller's current stream has queued and
        before what it queues next (events: the host does not wait)."""
        caller = cp.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        with self.stream:
            yield
        caller.wait_event(self.stream.record())

    def forward_backward(self, inputs, targets, ref=None, pair_weight=None, head_weights=None) -> None:
        """Loss into `self.loss`, gradients into `self.G`, sum of squared gradients into `self.sq`."""
        self._load_batch(inputs, targets, ref, pair_weight)
        self._set_head_weights(head_weights)
        with self._on_stream():
            self._forward_backward()
            self._logps = []
            self._keep_logps()

    def _keep_logps(self) -> None:
        if self.head == "dpo":  # a copy: the next micro-batch rewrites logp
            self._logps.append(self.logp.copy())

    def recompute_grad_norm(self) -> None:
        """The sum of squared gradients in `self.sq` again, from `self.G` as it is now (after a change of the
        gradients between `forward_backward` and `optimizer_step`, such as an all-reduce). ZeRO-1: of this
        rank's region (the ranks' sums add up to the global one)."""
        with self._on_stream():
            self._grad_norm()

    def _grad_norm(self, g=None) -> None:
        cp.cuda.runtime.memsetAsync(self.sq.data.ptr, 0, 4, self.stream.ptr)
        optim.sumsq(self.region(self.G if g is None else g), self.sq)

    def set_collective(self, fn) -> None:
        """Make fn(grads) part of every `step`, between the backward and the norm (recomputed after it):
        a data-parallel all-reduce, say. fn must only queue work on the current stream on the same buffers
        every step (no host sync, no allocation), as the step is captured into a CUDA graph with it."""
        if self.shards > 1:
            raise ValueError("a sharded engine averages its gradients itself (set_zero), not by a collective")
        self.collective = fn
        self._forget_graphs()

    def set_zero(self, comm) -> None:
        """Step as rank `rank` of ZeRO-1 over `comm` (a `train.parallel.Comm` of `shards` ranks), whose
        reduce-scatter, all-reduce sum and all-gather work in place on the flat buffers and, like
        `set_collective`'s fn, only queue work on the current stream (they are captured with the step)."""
        if (comm.size, comm.rank) != (self.shards, self.rank):
            raise ValueError(f"rank {comm.rank} of {comm.size} for an engine of rank {self.rank} of {self.shards}")
        self.zero = comm
        self._forget_graphs()

    def _forget_graphs(self) -> None:
        self._graph, self._eager_steps, self._graphs, self._eager = None, 0, {}, {}

    def _need_zero(self) -> None:
        if self.shards > 1 and self.zero is None:
            raise ValueError("a sharded engine steps through its ZeRO-1 transport (set_zero)")

    def optimizer_step(self, lr: float) -> None:
        """Clip (by the norm in `self.sq`) and apply AdamW to every parameter; refresh the bf16 image. ZeRO-1:
        to this rank's region (the others' come with the gathered weights, then `refresh_image`)."""
        self._set_hyper(lr)
        with self._on_stream():
            self._adamw()

    def step(self, inputs, targets, lr: float | None = None, ref=None, pair_weight=None, head_weights=None) -> None:
        """One training step (forward, backward, clipping, AdamW), queued without a host sync. head_weights:
        the output heads' loss weights (`transformer.mtp_cross_entropy`; None: all 1).

        The first step runs kernel by kernel; it compiles the kernels and lets cuBLAS choose its
        algorithms. The second is captured into a CUDA graph (`graph=True`), and from then on a step is
        the copy of the batch and of AdamW's per-step values into the engine's buffers, and one launch of
        that graph: the GPU runs the step's ~500 kernels back to back, without a launch gap between them."""
        self._need_zero()
        self._load_batch(inputs, targets, ref, pair_weight)
        self._set_head_weights(head_weights)
        self._set_hyper(self.lr if lr is None else float(lr))
        with self._on_stream():
            if self._graph is None and self.graph and self._eager_steps:
                self._graph = self._capture()
            if self._graph is not None:
                self._graph.launch(self.stream)
            else:
                self._step_body()
                self._eager_steps += 1
            self._logps = []
            self._keep_logps()

    def step_accum(self, micro, lr: float | None = None, head_weights=None) -> None:
        """One update from several micro-batches (`accumulate`, then `update`): what `step` makes of their
        concatenation. Each phase is a CUDA graph from its second use, as `step` is."""
        self.accumulate(micro, head_weights)
        self.update(lr)

    def accumulate(self, micro, head_weights=None) -> None:
        """The forward and backward of each micro-batch, gradients summed into `Gacc`, losses into `loss_acc`.

        micro: [(inputs, targets)], with the DPO head [(inputs, targets, ref, pair_weight)] (the pair weights
        already 1 / pairs of the whole step). The cross-entropy's per-head scale is that of all micro-batches'
        targets together (host arrays: counted here), as `mtp_cross_entropy` of the concatenated batch has it."""
        if self.Gacc is None:
            raise ValueError("this engine was built without accum=True")
        self._set_head_weights(head_weights)
        if self.head == "ce":
            self._set_scale([mb[1] for mb in micro])
        with self._on_stream():
            for buf in (self.Gacc, self.loss_acc):
                cp.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, self.stream.ptr)
        self._logps = []
        for mb in micro:
            self._load_batch(*mb)
            with self._on_stream():
                self._run("micro", self._micro_body)
                self._keep_logps()

    def update(self, lr: float | None = None) -> None:
        """After `accumulate`: the collective (if any) on the summed gradients, their norm, clip + AdamW."""
        self._need_zero()
        self._set_hyper(self.lr if lr is None else float(lr))
        with self._on_stream():
            self._run("update", self._update_body)

    def _set_scale(self, targets) -> None:
        """head_scale[k] = w[k] / (valid targets of head k * the sum of w over the heads with any) over all
        the micro-batches (w: the step's head weights), in float32 as `ce_head_scale` computes it, queued
        like AdamW's values."""
        K, w = self.cfg.mtp_heads, self._head_w_host
        counts = sum(np.count_nonzero(np.asarray(y).reshape(-1, K) >= 0, axis=0) for y in targets)
        total = np.float32(sum((w[k] for k in range(K) if counts[k]), np.float32(0)))
        self._scale_host[:] = [w[k] / (np.float32(c) * total) if c and w[k] > 0 else 0 for k, c in enumerate(counts)]
        cp.cuda.runtime.memcpyAsync(
            self.head_scale.data.ptr,
            self._scale_host.ctypes.data,
            self._scale_host.nbytes,
            cp.cuda.runtime.memcpyHostToDevice,
            cp.cuda.get_current_stream().ptr,
        )

    def _micro_body(self) -> None:
        self._forward_backward(accumulating=True)
        optim.grad_accumulate(self.G, self.Gacc, self.loss, self.loss_acc)

    def _update_body(self) -> None:
        if self.zero is not None:
            self._zero_update(self.Gacc)
        else:
            if self.collective is not None:  # once per update, on the sums
                self.collective(self.grads(accumulated=True))
            self._grad_norm(self.Gacc)
            self._adamw(self.Gacc)
        cp.cuda.runtime.memcpyAsync(
            self.loss.data.ptr, self.loss_acc.data.ptr, 4, cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr
        )

    def _run(self, key: str, body) -> None:
        """body kernel by kernel on its first call, then captured once and replayed (as `step` does)."""
        graph = self._graphs.get(key)
        if graph is None and self.graph and self._eager.get(key):
            graph = self._graphs[key] = self._capture(body)
        if graph is not None:
            graph.launch(self.stream)
        else:
            body()
            self._eager[key] = self._eager.get(key, 0) + 1

    def _step_body(self) -> None:
        self._forward_backward()
        if self.zero is not None:
            self._zero_update(self.G)
        else:
            if self.collective is not None:  # the gradients changed (averaged over the ranks): their norm again
                self.collective(self.grads())
                self._grad_norm()
            self._adamw()

    def _zero_update(self, g) -> None:
        """ZeRO-1's update from this rank's gradients g (G, or the accumulated Gacc), in place throughout.
        The master weights are gathered rather than the bf16 image because the embedding's forward and
        the norm gains read P; a reduce-scatter and an all-gather of float32 move the bytes of the
        all-reduce they replace, and the image is refreshed locally (an elementwise pass)."""
        comm = self.zero
        comm.reduce_scatter_mean(g, self.region(g))  # this region's gradients, averaged over the ranks
        self._grad_norm(g)  # their sum of squares ...
        comm.all_reduce_sum([self.sq])  # ... added over the regions: the global norm's
        self._adamw(g)  # clip, and AdamW / Muon on this region
        comm.all_gather(self.region(self.P), self.P)  # every region's new master weights
        self._refresh_image()  # the whole bf16 image (gains folded) and wdt, as the unsharded step leaves them

    def _capture(self, body=None):
        """The whole step (or `body`) as a CUDA graph, or None (with a warning) where capture fails."""
        try:
            self.stream.begin_capture()
            try:
                (body or self._step_body)()
            finally:
                graph = self.stream.end_capture()
            return graph
        except Exception as exc:  # e.g. a CuPy or driver without stream capture: run kernel by kernel
            warnings.warn(
                f"capturing the training step into a CUDA graph failed ({type(exc).__name__}: {exc}); "
                "running it kernel by kernel",
                RuntimeWarning,
                stacklevel=3,
            )
            self.graph = False
            return None

    def _set_head_weights(self, head_weights) -> None:
        """Queue the output heads' loss weights of this step (None: all 1) for `ce_head_scale`, as `_set_hyper`
        queues AdamW's values: the captured step reads them from the device."""
        if self.head != "ce":
            if head_weights is not None:
                raise ValueError("head weights are for the cross-entropy head")
            return
        K = self.cfg.mtp_heads
        w = np.ones(K) if head_weights is None else np.asarray(head_weights, dtype=np.float64)
        if w.shape != (K,) or not np.all(w >= 0):
            raise ValueError(f"head weights must be {K} values >= 0, got {head_weights!r}")
        self._head_w_host[:] = w
        cp.cuda.runtime.memcpyAsync(
            self.head_w.data.ptr,
            self._head_w_host.ctypes.data,
            self._head_w_host.nbytes,
            cp.cuda.runtime.memcpyHostToDevice,
            cp.cuda.get_current_stream().ptr,
        )

    def _set_hyper(self, lr: float) -> None:
        """Count the step and queue each lr group's values for it (AdamW: step size, 1/sqrt(1 - b2^t),
        decay factor; Muon: lr, -, decay factor) on the current stream; the copy from pageable memory is
        staged at once, so the host never waits."""
        self.t += 1
        inv_sqrt_bc2 = 1.0 / math.sqrt(1.0 - self.beta2**self.t)
        for gi, group in enumerate(GROUPS):
            lr_g = lr * self.group_scale[group]
            step = lr_g if group == "hidden" and self.optimizer == "muon" else lr_g / (1.0 - self.beta1**self.t)
            self._hyper_host[3 * gi : 3 * gi + 3] = (step, inv_sqrt_bc2, 1.0 - lr_g * self.weight_decay)
        cp.cuda.runtime.memcpyAsync(
            self.hyper.data.ptr,
            self._hyper_host.ctypes.data,
            self._hyper_host.nbytes,
            cp.cuda.runtime.memcpyHostToDevice,
            cp.cuda.get_current_stream().ptr,
        )

    def _forward_backward(self, accumulating: bool = False) -> None:
        """`transformer.loss_and_grads`: embedding, blocks, final norm, heads' loss, and back.
        accumulating: a micro-batch of `accumulate` (the head scale is the step's; the norm comes later)."""
        L = self.cfg.n_layers
        stream = cp.cuda.get_current_stream().ptr
        # Every gradient is overwritten by the step (GEMMs with beta=0, the first output-head chunk included,
        # and the norm gains' column sums) except the embedding's, which the backward scatters into
        # with atomics: only it is zeroed (the padding between tensors stays zero from __init__).
        cp.cuda.runtime.memsetAsync(self.demb.data.ptr, 0, self.demb.nbytes, stream)
        cp.cuda.runtime.memsetAsync(self.sq.data.ptr, 0, 4, stream)
        if self.head == "ce" and not accumulating:
            heads.ce_head_scale(self.tg, self.head_w, self.head_scale)
        embed.embed_fwd(self.ids, self.emb, self.xs[0])
        for i in range(L):
            self.block_forward(i)
        # the trunk's output, normed: the stream after the last layer = its input + both its branches
        norms.rmsnorm_fwd(
            self.xs[(L - 1) % len(self.xs)], self.xn, self.rstdf, self.cfg.norm_eps, add=(self.ob, self.ybr)
        )
        if self.head == "ce":
            self.heads_loss()
        else:
            self.seq_logp_loss()
        # the final norm's backward: its gain's gradient from the heads' folded weight gradients, then dx
        norms.gain_fold(*self.fold_heads, self.gpart, self.sq)
        norms.rmsnorm_bwd(self.dxn, self.xn, self.rstdf, self.dx, self.dxb, accumulate=False)
        for i in reversed(range(L)):
            if self.checkpoint and i < L - 1:  # the last layer's activations are still the forward's
                self.block_forward(i, recompute=True)
            self.block_backward(i)
        embed.embed_bwd(self.dx, self.ids, self.demb)
        # the gradient norm: the folded matrices added their squares already; the rest lie before them
        # (a collective changes the gradients: `_step_body` takes the whole norm after it instead; an
        # accumulating step takes it over the sums)
        if self.collective is None and self.zero is None and not accumulating:
            optim.sumsq(self.G[: self.fold_start], self.sq)

    def block_forward(self, i: int, recompute: bool = False) -> None:
        """`transformer._block_forward` of layer i. The residual stream: x_in = xs[i % len(xs)], which the
        first norm writes as the previous layer's x_in + its o_proj branch + its down branch; x_mid = x_in + ob
        is never stored (the second norm adds ob itself); x_out = x_mid + ybr is the next layer's to write.
        recompute (checkpointing, in the backward): from the kept x_in, what the backward reads (the same
        kernels on the same values: bit-identical), not the down branch."""
        nx = len(self.xs)
        w, x, eps = self.Lw[i], self.xs[i % nx], self.cfg.norm_eps
        if i == 0 or recompute:  # h = rmsnorm(x), its gain folded into the weights that read h
            norms.rmsnorm_fwd(x, self.xh1[i], self.rstd1[i], eps)
        else:
            norms.rmsnorm_fwd(self.xs[(i - 1) % nx], self.xh1[i], self.rstd1[i], eps, add=(self.ob, self.ybr), out=x)
        self.qkv_rope(i)  # q, k, v = rope(q(h)), rope(k(h)), v(h)
        if self.attention != "fp32":  # a = attention(q, k, v), in the o_proj operand's layout
            flash.flash_fwd(self._flash, self.q[i], self.k[i], self.v[i], self.a[i], self.lse[i])
        else:
            flash.flash_fwd_f32(self._flash, self.q[i], self.k[i], self.v[i], self.att, self.lse[i])
            rope.attn_pack(self.att, self.a[i])
        self.gemm(self.mob, self.ma[i], w["o"], tb=True)  # x_mid = x + o_proj(a)
        norms.rmsnorm_fwd(x, self.xh2[i], self.rstd2[i], eps, add=(self.ob,))  # h2 = rmsnorm(x_mid)
        if self.fuse_swiglu:  # gu = gate/up(h2) and m = silu(gate) * up in one kernel
            run_swiglu_fwd_gemm(
                self._swiglu_fwd_gemm,
                self.xh2_maps[i],
                self.wgu_maps[i],
                self.gu_maps[i],
                self.m_map,
                self.N,
                self.cfg.dim,
                self.cfg.hidden,
                self.sms,
            )
        else:
            self.gemm(self.mgu[i], self.mxh2[i], w["gu"], tb=True)
            if not recompute:  # (the SwiGLU backward recomputes m)
                swiglu.swiglu_fwd(self.gu[i], self.m)
        if not recompute:
            self.gemm(self.mybr, self.mm, w["d"], tb=True)  # x_out = x_mid + down(m)

    def qkv_rope(self, i: int) -> None:
        """q/k/v of layer i in the attention layout, q and k rotated: inside the qkv GEMM (fuse_rope), or
        the GEMM into `qkv` and a kernel that splits and rotates it."""
        cfg = self.cfg
        if self.fuse_rope:
            run_qkv_rope_gemm(
                self._qkv_rope_gemm,
                self.xh1_maps[i],
                self.wqkv_maps[i],
                *self.qkv_maps[i],
                self.cos,
                self.sin,
                self.N,
                cfg.dim,
                self.T,
                cfg.n_heads,
                cfg.n_kv_heads,
                self.sms,
            )
        else:
            self.gemm(self.mqkv, self.mxh1[i], self.Lw[i]["qkv"], tb=True)
            rope.qkv_rope_split(self.qkv, self.cos, self.sin, self.q[i], self.k[i], self.v[i])

    def heads_loss(self) -> None:
        """`transformer.mtp_cross_entropy` on the normed state xn: the loss into `self.loss`, dL/dxn summed
        over the heads into `dxn`, the heads' (folded) weight gradients. One head and one chunk of R rows at
        a time, so logits (R, V) never exist for all rows; per head rather than all K at once, so the weight
        gradient each chunk's GEMM reads and writes back in float32 is one head's (V, C), not (K V, C)."""
        R, gemm = self.R, self.gemm
        for r0 in range(0, self.N, R):
            r1 = min(self.N, r0 + R)
            lg = Matrix(self.logits[: r1 - r0])  # the logits, then (in place) their gradient
            xc, dxc = Matrix(self.xn[r0:r1]), Matrix(self.dxn[r0:r1])
            for h, (wh, dwh) in enumerate(zip(self.w_head, self.dw_head)):
                gemm(lg, xc, wh, tb=True)
                heads.ce_heads(lg.arr, self.tg[r0:r1], self.head_scale, self.loss_rows[r0:r1], h)
                gemm(dxc, lg, wh, beta=0.0 if h == 0 else 1.0)
                gemm(dwh, lg, xc, ta=True, beta=0.0 if r0 == 0 else 1.0)
        heads.ce_loss_reduce(self.loss_rows, self.head_scale, self.loss)

    def seq_logp_loss(self) -> None:
        """`model.dpo.dpo_head_loss` on xn: pass 1 over the row chunks gives each row's log-prob of its
        head-0 target; one block sums them by sequence and takes the pair loss and dloss/dlogp against the
        reference; pass 2 makes the logits again, turns them into their gradient dlogp[b] (onehot - softmax)
        and runs the dxn and head-0 weight GEMMs. Heads 1..K-1 keep zero gradients (G is never written there)."""
        R, gemm, w0, dw0 = self.R, self.gemm, self.w_head[0], self.dw_head[0]
        chunks = [(r0, min(self.N, r0 + R)) for r0 in range(0, self.N, R)]
        for r0, r1 in chunks:
            lg = Matrix(self.logits[: r1 - r0])
            gemm(lg, Matrix(self.xn[r0:r1]), w0, tb=True)
            heads.seq_logp_rows(lg.arr, self.tg[r0:r1], self.tok[r0:r1], self.lse_rows[r0:r1])
        heads.dpo_pair_loss(
            self.tok, self.ref, self.pair_w, self.logp, self.dlogp, self.loss, self.T, self.dpo_beta, self.dpo_eps
        )
        for r0, r1 in chunks:
            lg, xc = Matrix(self.logits[: r1 - r0]), Matrix(self.xn[r0:r1])
            gemm(lg, xc, w0, tb=True)
            heads.seq_logp_grad(lg.arr, self.tg[r0:r1], self.lse_rows[r0:r1], self.dlogp, r0, self.T)
            gemm(Matrix(self.dxn[r0:r1]), lg, w0)
            gemm(dw0, lg, xc, ta=True, beta=0.0 if r0 == 0 else 1.0)

    def block_backward(self, i: int) -> None:
        """`transformer._block_backward` of layer i: dx (and its bf16 copy dxb) is the gradient at x_out on
        entry and at x_in on return; the weights' gradients go into G. The GEMMs through gain-folded
        weights give dL/dxhat, and `norms.gain_fold` turns their weight gradients into W's and the gain's."""
        w, gemm = self.Lw[i], self.gemm
        # MLP branch: x_out = x_mid + down(silu(gate(h2)) * up(h2)); the SwiGLU backward recomputes m
        if self.fuse_swiglu:  # dm = dx Wd and the SwiGLU backward in one kernel, dm never stored
            run_swiglu_bwd_gemm(
                self._swiglu_bwd_gemm,
                self.dy_map,
                self.wdt_map,
                i * self.cfg.hidden,
                self.gu_maps[i],
                self.dgu_map,
                self.m_map,
                self.N,
                self.cfg.dim,
                self.cfg.hidden,
                self.sms,
            )
        else:
            gemm(self.mdm, self.mdxb, w["d"])
            swiglu.swiglu_bwd(self.dm, self.gu[i], self.dgu, self.m)
        gemm(w["dd"], self.mdxb, self.mm, ta=True)
        gemm(self.mdh, self.mdgu, w["gu"])  # dL/dxhat2
        norms.rmsnorm_bwd(self.dh, self.xh2[i], self.rstd2[i], self.dx, self.dxb, accumulate=True)  # dx at x_mid
        gemm(w["dgu"], self.mdgu, self.mxh2[i], ta=True)
        norms.gain_fold(*w["fold_gu"], self.gpart, self.sq)
        # attention branch: x_mid = x_in + o(attn(rope(q(h)), rope(k(h)), v(h)))
        gemm(w["do"], self.mdxb, self.ma[i], ta=True)
        gemm(self.mda, self.mdxb, w["o"])
        self.attention_backward(i)  # dq, dk, dv (rotation undone) into dqkv
        gemm(self.mdh, self.mdqkv, w["qkv"])  # dL/dxhat1
        norms.rmsnorm_bwd(self.dh, self.xh1[i], self.rstd1[i], self.dx, self.dxb, accumulate=True)  # dx at x_in
        gemm(w["dqkv"], self.mdqkv, self.mxh1[i], ta=True)
        norms.gain_fold(*w["fold_qkv"], self.gpart, self.sq)

    def attention_backward(self, i: int) -> None:
        """dq, dk (rotation undone) and dv of layer i as bf16 into dqkv, the qkv GEMM's gradient operand."""
        q, k, v = self.q[i], self.k[i], self.v[i]
        if self.attention != "fp32":
            flash.flash_bwd(
                self._flash, q, k, v, self.a[i], self.da, self.lse[i], self.delta, self.dqkv, self.cos, self.sin
            )
        else:
            rope.attn_delta(self.a[i], self.da, self.delta)
            flash.flash_bwd_f32(self._flash, q, k, v, self.da, self.lse[i], self.delta, self.att, self.dk, self.dv)
            rope.rope_bwd_pack(self.att, self.dk, self.dv, self.cos, self.sin, self.dqkv)

    def _adamw(self, g=None) -> None:
        """The update: AdamW on every run (under Muon, on every run but the hidden matrices', which Muon
        updates after the gains it folds into their images). ZeRO-1: the runs of this rank's region; the
        image of the others comes with the gathered weights (`_zero_update`)."""
        g = self.G if g is None else g
        muon = self.optimizer == "muon"
        for start, end, decayed, gain, cols, gi in self.runs:  # every gain before the images that fold it in
            if muon and GROUPS[gi] == "hidden":
                continue
            s, m = slice(start, end), slice(start - self.base, end - self.base)
            optim.adamw_clip(
                self.P[s],
                g[s],
                self.Mo[m],
                self.Vo[m],
                self.Pb[s],
                self.sq,
                self.hyper[3 * gi :],
                decayed,
                self.max_norm,
                self.beta1,
                self.beta2,
                self.eps,
                gain,
                cols,
            )
        if muon:
            self._muon(g)
        if self.shards == 1:
            self._refresh_wdt()

    # ---- Muon ------------------------------------------------------------------------------------------

    def _muon_plan(self) -> None:
        """Under Muon, one `MuonShape` per hidden matrix shape of a layer (q, k, v, o, gate, up, down): each
        is that matrix in every layer (ZeRO-1: every layer of this rank's region), a constant stride apart in
        the flat buffers, and orthogonalised as one batch. Their Newton-Schulz operands live in the second
        moment's buffer, unused by Muon's matrices (two bf16 matrices in each float32 one's place); the
        products X X^T and their polynomial, and the per-layer norms, in the arena, which is dead once the
        backward ends."""
        self.muon_shapes, self.muon_scratch = [], None
        owned = set(self.owned)
        layers = [i for i in range(self.cfg.n_layers) if f"layers.{i}.mlp.down_proj.weight" in owned]
        if self.optimizer != "muon" or not layers:
            return
        L = len(layers)
        vb = self.Vo.view(BF16_STORAGE)
        gains = {"self_attn": "input_layernorm", "mlp": "post_attention_layernorm"}
        for name in HIDDEN_MATRICES:
            names = [f"layers.{i}.{name}.weight" for i in layers]
            offs = [self.offsets[n] for n in names]
            stride = offs[1] - offs[0] if L > 1 else 0
            if any(b - a != stride for a, b in zip(offs, offs[1:])):
                raise ValueError(f"the layers' {name} do not lie a constant stride apart")
            rows, cols = self.shapes[names[0]]
            folded = names[0] in self.layout.gain_of
            gain = _NULL
            gstride = 0
            if folded:
                gname = [f"layers.{i}.{gains[name.split('.')[0]]}.weight" for i in layers]
                gain = self.view(self.P, gname[0])
                gstride = self.offsets[gname[1]] - self.offsets[gname[0]] if L > 1 else 0
                assert all(self.layout.gain_of[n] == g for n, g in zip(names, gname))
            decayed = [r[2] for r in self.runs if r[0] <= offs[0] < r[1]][0]
            x = vb[2 * (offs[0] - self.base) :]
            self.muon_shapes.append(
                MuonShape(
                    name,
                    L,
                    offs[0],
                    stride,
                    rows,
                    cols,
                    decayed,
                    muon_scale((rows, cols)),
                    gain,
                    gstride,
                    x,
                    x[rows * cols :],
                )
            )
        m = max(min(sh.rows, sh.cols) for sh in self.muon_shapes)
        parts, need = carve(
            [((L, m, m), BF16_STORAGE), ((L, m, m), BF16_STORAGE), ((len(self.muon_shapes), L), np.float32)]
        )
        store = self.arena if self.arena.nbytes >= need else cp.empty(need, dtype=np.uint8)  # (a tiny model's arena)
        self.muon_scratch = None if store is self.arena else store
        self.ns_a, self.ns_b, self.muon_ss = (store[o : o + n].view(dt).reshape(sh) for o, n, sh, dt in parts)

    def _muon(self, g) -> None:
        """`optim.Muon.step` on the hidden matrices: the clipped gradient's Nesterov momentum, normalised, 5
        Newton-Schulz steps as batched bf16 GEMMs, the scaled update and the bf16 image (gains folded in)."""
        if not self.muon_shapes:  # (a ZeRO-1 region without layers)
            return
        stream = self.stream.ptr
        hidden = self.hyper[3 * GROUPS.index("hidden") :]
        cp.cuda.runtime.memsetAsync(self.muon_ss.data.ptr, 0, self.muon_ss.nbytes, stream)
        for k, sh in enumerate(self.muon_shapes):
            n, xs, ss, L = sh.rows * sh.cols, 2 * sh.stride, self.muon_ss[k], sh.layers
            optim.muon_momentum(
                g[sh.start :],
                self.Mo[sh.start - self.base :],
                sh.x,
                n,
                sh.stride,
                xs,
                L,
                ss,
                self.sq,
                self.max_norm,
                self.muon_momentum,
            )
            optim.muon_normalize(sh.x, n, xs, L, ss)
            o = self._newton_schulz(sh)
            optim.muon_update(
                self.P[sh.start :],
                o,
                self.Pb[sh.start :],
                n,
                sh.stride,
                xs,
                L,
                hidden,
                sh.decayed,
                sh.scale,
                sh.gain,
                sh.gstride,
                sh.cols,
            )

    def _newton_schulz(self, sh):
        """`optim.newton_schulz` on every layer's matrix of one shape at once, in bf16 on the tensor cores:
        A = X X^T (X^T X for a tall X), B = a I + b A + c A A, X' = B X (X B), ping-ponging between sh.x and
        sh.y. Returns the bf16 array that holds the result (matrix l at l * 2 stride)."""
        a_, b_, c_ = NS_COEFFS
        L, r, c = sh.layers, sh.rows, sh.cols
        m, xs, tall = min(r, c), 2 * sh.stride, r > c
        mm, gemm = m * m, self.gemm
        A, B = (Matrix(buf.reshape(-1)[:mm].reshape(m, m)) for buf in (self.ns_a, self.ns_b))  # layer l's: l mm on
        cur, nxt = sh.x, sh.y
        for _ in range(NS_STEPS):
            X, Y = Matrix(cur[: r * c].reshape(r, c)), Matrix(nxt[: r * c].reshape(r, c))
            gemm.batched(A, X, X, L, (mm, xs, xs), ta=tall, tb=not tall)
            optim.muon_poly_init(A.arr, B.arr, m, L, a_, b_)
            gemm.batched(B, A, A, L, (mm, mm, mm), alpha=c_, beta=1.0)
            if tall:
                gemm.batched(Y, X, B, L, (xs, xs, mm))
            else:
                gemm.batched(Y, B, X, L, (xs, mm, xs))
            cur, nxt = nxt, cur
        return cur

    def _refresh_wdt(self) -> None:
        """`swiglu_bwd_gemm`'s image of every layer's Wd, from the bf16 image (nothing when not fused)."""
        if self.fuse_swiglu:
            wdt_image(self.Pb, self.wd_offsets, self.wdt)
