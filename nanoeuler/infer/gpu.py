"""The decode engine's GPU backend: bf16 (or float32) weights, a preallocated cache, CUDA-graph decode steps.

    >>> be = GpuBackend(params, cfg, dtype="bf16")     # params: NumPy or CuPy float32        # doctest: +SKIP
    >>> be.start(1, seeds=[0]); be.prefill(0, ids)       # (K, V) logits of the prompt's last row   # doctest: +SKIP

The model runs over rows (token, cache slot, position) with the kernels of `kernels/decode.cu`; see
`engine.py` for the interface. Three ways through a layer, the same arithmetic:

  * one row (batch-1 steps): three kernels, the qkv GEMV (the RMSNorm in its prologue, RoPE and the cache
    write in its epilogue), attention with the o projection (`attend_o_cluster`: the 8 blocks of a head,
    a thread block cluster, each attend over an eighth of the keys, exchange their partial softmax
    through distributed shared memory and add their eighth of W_o's rows to x; up to ALONE_KEYS keys
    each attends over all of them; below compute capability 9.0 `attend_o`, every block over all keys),
    and the MLP (`swiglu_down`: gate/up, silu(g) * u, and each block's
    share of the down projection added to dx, which the next layer folds into x). The branches join by
    atomicAdd, so float sums may differ in the last bits from run to run. Head 0 and the argmax are one
    kernel (`head_argmax`).
  * 2 to 16 rows (verify passes, small batches, short prefills): five kernels, qkv, attention, o (+= x),
    gate/up (-> silu(g) * u), down (+= x); with bf16 weights the products run on the tensor cores
    (`tgemv_*`: mma.sync, x split into bf16 hi + lo, so the activations keep about 16 bits), else as
    float GEMVs. Such products are bound by the weight bandwidth and a step by its kernel boundaries, so
    every kernel requests its weights (into registers, or shared memory by cp.async) before it waits for
    the one before it: on compute capability 9.0 each is launched with programmatic dependent launch
    (`launch.py`) and may start while that one still runs.
  * many rows (prefill, wide batches): cuBLAS GEMMs (bf16 operands, float32 accumulation, through ctypes so
    that they can be captured) between elementwise kernels; a prefill's attention is the training engine's
    tensor-core FlashAttention (bf16, head size 32 or 64) over the prompt, a wide batch's a block per
    (row, key/value head) (`attend_kv_act`: the query heads that share the key/value head read it once).

A decode step (embedding, every layer, the final norm and head, the choice of the next token) is recorded
once per (rows, heads, rule) as a CUDA graph and replayed; per step the host copies in one small array
(ids, slots, positions, sampling values) and reads back the chosen ids: nothing else crosses, nothing is
allocated. Greedy steps feed themselves (`greedy_steps`, `greedy_passes`): the chosen ids become the
next step's inputs on the GPU and are written straight into pinned host memory, so the host queues steps
ahead and only reads ids. A prefill is recorded once per row count, prompts padded to a power of two (the
padding rows come after the prompt, so causal attention keeps them out of its rows, and the next steps
overwrite what they leave in the cache); prompts of up to GEMV_MAX_ROWS tokens take the GEMV path,
unpadded. A batch's prompts are prefilled together (`prefill_many`). Sampling (temperature, top-k, top-p)
draws from a counter-based generator seeded per slot.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from nanoeuler.model.layers import rope_tables
from nanoeuler.model.transformer import head_weight_names

# decode.cu's kernels per weight storage (`<stem>_bf16`, `<stem>_f32`; the GEMVs also per U), and its two others
GEMV_STEMS = ("gemv_store", "gemv_store2", "gemv_add", "gemv_swiglu", "gemv_rope", "head_argmax")
KERNELS = ("embed", "rope_cache", "attend", "attend_o", "attend_o_cluster", "attend_act", "attend_kv_act",
           "rmsnorm_act", "swiglu_act") + tuple(f"{e}_u{u}" for e in GEMV_STEMS for u in (4, 8)) \
    + tuple(f"swiglu_down_u{u}_r1" for u in (4, 8))
# the tensor-core GEMVs of a few rows (bf16 only, no storage suffix): tgemv_<epilogue>_c<chunks a warp>
TC_KERNELS = tuple(f"tgemv_{e}_c{c}" for e in ("store", "add") for c in (4, 8)) + ("tgemv_swiglu_c4", "tgemv_rope_c4")
GEMV_MAX_ROWS = 16  # decode batches above this many rows take the cuBLAS path
GEMV_ROWS, GEMV_WARPS, MLP_FC, TC_WARPS = 4, 8, 16, 8  # as decode.cu
OSPLIT = 8  # attend_o's row splits, at most; attend_o_cluster's cluster (as decode.cu's OC_SPLIT)
OC_WARPS = 8
ALONE_KEYS = 96  # up to this many keys each block of the cluster attends over all of them (measured: BENCHMARKS.md)
ATTEND_THREADS = 512
KV_WARPS, KV_MAXG = 8, 4  # attend_kv's warps a block, and query heads a key/value head at most (as decode.cu)
CHAIN_AHEAD, CHAIN_CAP = 3, 8  # greedy steps queued ahead of the host; the ring of their ids on the GPU


def to_bf16(a):
    """float32 CuPy array -> bf16 words (uint16), round to nearest even."""
    import cupy as cp

    u = cp.ascontiguousarray(a, dtype=cp.float32).view(cp.uint32)
    return ((u + cp.uint32(0x7FFF) + ((u >> cp.uint32(16)) & cp.uint32(1))) >> cp.uint32(16)).astype(cp.uint16)


class _Rows:
    """Activation buffers for up to M rows, allocated once per M. The meta of m <= M rows is the first
    3m entries of `ctl` (ids, slots, positions); the sampling values sit after all 3M."""

    def __init__(self, cp, cfg, M, n_out, wt):
        C, H, Hkv, D, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
        f32 = cp.float32
        self.M = M
        self.host = cp.cuda.alloc_pinned_memory(4 * (3 * M + 4))
        self.ctl_host = np.frombuffer(self.host, dtype=np.int32, count=3 * M + 4)
        self.ctl = cp.zeros(3 * M + 4, dtype=cp.int32)  # ids, slots, positions, sampling values
        self.meta, self.samp = self.ctl[:3 * M], self.ctl[3 * M:]
        self.slots = np.arange(M, dtype=np.int32)
        self.x = cp.zeros((M, C), f32)
        self.dx = cp.zeros((M, C), f32)  # the MLP branch not yet in x (the one-row path)
        self.qkv = cp.zeros((M, (H + 2 * Hkv) * D), f32)
        self.q = cp.zeros((M, H * D), f32)
        self.att = cp.zeros((M, H * D), f32)
        self.gu = cp.zeros((M, 2 * F), f32)
        self.m = cp.zeros((M, F), f32)
        self.act = cp.zeros(M * max(C, F, H * D), wt)  # GEMM operands (the cuBLAS path)
        self.logits = cp.zeros((M, n_out), f32)  # (M, heads, V) packed, for as many heads as asked
        self.out = cp.zeros(M * cfg.mtp_heads, cp.int32)
        self.out_host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * M * cfg.mtp_heads), dtype=np.int32)
        self.qh = self.kh = self.vh = self.lse = None  # a prefill's attention operands (`flash_operands`)
        # steps that feed themselves (greedy_steps, greedy_passes): their records, a ring in pinned host memory
        # that the kernels write straight into (with unified addressing its host pointer is valid on the GPU),
        # read by the host once the step's event has passed: no copy in the stream between steps
        self.rec = max(M, 2 * cfg.mtp_heads + 1)
        self._hist_mem = cp.cuda.alloc_pinned_memory(4 * CHAIN_CAP * self.rec)
        self.hist_host = np.frombuffer(self._hist_mem, dtype=np.int32, count=CHAIN_CAP * self.rec)
        self.hist = np.uint64(self.hist_host.ctypes.data)  # the kernels' pointer to it
        self.arrive = cp.zeros(1, cp.int32)
        self.best = cp.zeros(1, cp.uint64)  # head_argmax's running best (order key, ~index)

    def flash_operands(self, cp, cfg, wt):
        """q (1, H, M, D), k and v (1, Hkv, M, D) of W and the logsumexp (1, H, M): the FlashAttention's."""
        M, H, Hkv, D = self.M, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if self.qh is None:
            self.qh = cp.zeros((1, H, M, D), wt)
            self.kh, self.vh = cp.zeros((1, Hkv, M, D), wt), cp.zeros((1, Hkv, M, D), wt)
            self.lse = cp.zeros((1, H, M), cp.float32)
        return self.qh, self.kh, self.vh, self.lse

    def act2(self, m: int, width: int):
        """The GEMM-operand buffer as a contiguous (m, width) matrix."""
        return self.act[:m * width].reshape(m, width)


class GpuBackend:
    # a verify pass's time in decode steps (H100, the 116M model: 330 against 236 us; BENCHMARKS.md)
    verify_cost = 1.4

    def __init__(self, params: dict, cfg, dtype: str = "bf16", pdl: bool | None = None):
        """`pdl`: launch with programmatic dependent launch where the GPU has it (default: on, unless the
        environment sets NANOEULER_PDL=0)."""
        import cupy as cp

        from nanoeuler.kernels.pdl import pdl_launcher
        from nanoeuler.kernels import has_sm90a, kernel
        from nanoeuler.kernels.bf16.plan import MMA_HEAD_DIMS

        if dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype must be bf16 or fp32, got {dtype!r}")
        if cfg.vocab_size > 1024 * 64:  # sample_rows keeps SAMPLE_PER_THREAD = 64 logits per thread
            raise ValueError(f"the GPU sampler handles vocabularies of up to 65536 tokens, not {cfg.vocab_size}")
        if cfg.dim % OSPLIT:  # attend_o's row splits (OSPLIT or a power of two below)
            raise ValueError(f"the GPU decode engine needs a width divisible by {OSPLIT}, not {cfg.dim}")
        self.cp, self.cfg, self.dtype = cp, cfg, dtype
        # the kernel paths; each switch is a variant of bench/decode_steps_gpu.py (BENCHMARKS.md has the figures)
        vec = 8 if dtype == "bf16" else 4  # weights or cache values a 16-byte load
        self.tensor_cores = True  # 2 to 16 rows of bf16 weights: tgemv (mma.sync); off: the float GEMV
        # one row: attention split over a cluster of 8 blocks (a key's 16-byte pieces on at most a warp's lanes;
        # clusters need compute capability 9.0), each alone up to alone_keys keys; else attend_o
        self.attend_cluster = cfg.head_dim % vec == 0 and cfg.head_dim // vec <= 32 and \
            int(cp.cuda.Device().compute_capability) >= 90
        self.alone_keys = ALONE_KEYS
        self.fuse_argmax = True  # one row's greedy id in the head's own kernel (head_argmax)
        # wide batches: attend_kv_act, a block per (row, key/value head) (its lane groups of D / vec lanes
        # must divide the warp); else attend_act, a block per (row, head)
        self.attend_kv = cfg.head_dim % vec == 0 and 32 % (cfg.head_dim // vec) == 0 \
            and cfg.n_heads // cfg.n_kv_heads <= KV_MAXG
        self._kv_groups = KV_WARPS * 32 // max(1, cfg.head_dim // vec)  # attend_kv_act's lane groups a block
        self.wt = cp.uint16 if dtype == "bf16" else cp.float32
        suffix = "bf16" if dtype == "bf16" else "f32"
        self.k = {n: kernel("decode", f"{n}_{suffix}") for n in KERNELS}
        if dtype == "bf16":
            self.k.update({n: kernel("decode", n) for n in TC_KERNELS})
        self.k["argmax_rows"] = kernel("decode", "argmax_rows")
        self.k["sample_rows"] = kernel("decode", "sample_rows")
        self.k["argmax_chain"] = kernel("decode", "argmax_chain")
        self.k["accept_chain"] = kernel("decode", "accept_chain")
        if pdl is None:
            pdl = os.environ.get("NANOEULER_PDL", "1") != "0"
        self.pdl = pdl_launcher() if pdl else None
        if self.pdl is not None:  # one launch to see that the driver takes it
            try:
                probe = cp.zeros(2, cp.int32)
                self.pdl(self.k["argmax_rows"], (1,), (32,), (probe.view(cp.float32), np.int32(1), np.int64(1), probe))
                cp.cuda.Device().synchronize()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"programmatic dependent launch failed ({exc}); launching the ordinary way")
                self.pdl = None
        self._flash = None  # the prefill's attention: bf16 operands and a head size the tensor-core kernels have
        if dtype == "bf16" and cfg.head_dim in MMA_HEAD_DIMS:
            from nanoeuler.kernels.bf16 import flash

            self._flash = flash.flash_kernels("wg" if cfg.head_dim == 64 and has_sm90a() else "ldm", cfg.head_dim)
        W = (lambda a: to_bf16(cp.asarray(a, dtype=cp.float32))) if dtype == "bf16" else \
            (lambda a: cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32)))
        g32 = lambda a: cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32))  # noqa: E731
        p = params
        self.emb = W(p["embed_tokens.weight"])
        self.layers = []
        for i in range(cfg.n_layers):
            n = f"layers.{i}."
            self.layers.append(dict(
                n1=g32(p[n + "input_layernorm.weight"]), n2=g32(p[n + "post_attention_layernorm.weight"]),
                qkv=W(cp.concatenate([cp.asarray(p[n + f"self_attn.{w}_proj.weight"], dtype=cp.float32)
                                      for w in "qkv"])),
                o=W(p[n + "self_attn.o_proj.weight"]),
                gu=W(cp.concatenate([cp.asarray(p[n + f"mlp.{w}_proj.weight"], dtype=cp.float32)
                                     for w in ("gate", "up")])),
                down=W(p[n + "mlp.down_proj.weight"])))
        self.norm = g32(p["norm.weight"])
        cos, sin = rope_tables(cfg.ctx_len, cfg.head_dim, cfg.rope_theta, np, np.float32)  # as the reference
        self.cos, self.sin = cp.asarray(cos), cp.asarray(sin)
        self.heads = W(cp.concatenate([cp.asarray(p[h], dtype=cp.float32) for h in head_weight_names(cfg)]))
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
        self._gemm = None
        self._rows: dict[int, _Rows] = {}
        self._graphs: dict = {}
        self.kc = self.vc = None
        self.seeds = None
        self.use_graphs = True
        self._landed = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(CHAIN_CAP)]  # per record

    # ---- buffers ------------------------------------------------------------------------------------

    def start(self, batch: int, seeds=None) -> None:
        cp, cfg = self.cp, self.cfg
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, cfg.ctx_len, cfg.head_dim)
        if self.kc is None or self.kc.shape != shape:
            self.kc = cp.zeros(shape, self.wt)
            self.vc = cp.zeros(shape, self.wt)
            self._graphs.clear()  # graphs hold the old cache's pointers
        seeds = list(seeds) if seeds is not None else list(range(batch))
        mixed = [(int(s) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019 * (b + 1)) % 2**64 for b, s in enumerate(seeds)]
        if self.seeds is None or self.seeds.shape[0] != batch:
            self.seeds = cp.zeros(batch, cp.uint64)
        self.seeds.set(np.array(mixed, dtype=np.uint64))

    def _buffers(self, M: int) -> _Rows:
        if M not in self._rows:
            self._rows[M] = _Rows(self.cp, self.cfg, M, self.cfg.mtp_heads * self.cfg.vocab_size, self.wt)
        return self._rows[M]

    def gemm(self):
        if self._gemm is None:
            from nanoeuler.kernels.cublas import Gemm

            self._gemm = Gemm(self.stream)
        return self._gemm

    # ---- the forward over rows ------------------------------------------------------------------------

    def _launch(self, name: str, grid, block, args, shared_mem: int = 0, pdl: bool = True) -> None:
        """Launch decode.cu's kernel `name` on the backend's stream (with PDL where the backend has it)."""
        if self.pdl is not None and pdl:
            self.pdl(self.k[name], grid, block, args, shared_mem=shared_mem, stream=self.stream)
        else:
            self.k[name](grid, block, args, shared_mem=shared_mem, stream=self.stream)

    def _u(self, K: int) -> int:
        """16-byte pieces per lane and weight row in flight in a GEMV over rows of K."""
        return 4 if -(-K // (32 * (8 if self.dtype == "bf16" else 4))) <= 4 else 8

    def _tc(self, M: int, K: int, paired: bool = False) -> int:
        """Chunks a warp (4 or 8; 4 only for the `paired` epilogues, swiglu and rope) of the tensor-core GEMV
        for M rows of K, or 0 where it does not apply."""
        if self.dtype != "bf16" or not self.tensor_cores or not 2 <= M <= 16 or K % 32:
            return 0
        per_warp = -(-K // (32 * TC_WARPS))
        return 4 if per_warp <= 4 else 8 if per_warp <= 8 and not paired else 0

    def _gemv(self, epi: str, w, x, x2, gain, y, M: int, N: int, K: int, pdl: bool = True) -> None:
        """y = W (norm(x + x2)) over M rows (x2 and gain may be None), `epi` as decode.cu: store, store2, add,
        swiglu (N = outputs, or pairs of outputs for store2). 2 to 16 rows of bf16 weights take the
        tensor-core GEMV (store2 as store)."""
        null = np.uint64(0)
        ch = self._tc(M, K, paired=epi == "swiglu")
        if ch:
            if epi == "store2":
                epi, N = "store", 2 * N
            self._launch(f"tgemv_{epi}_c{ch}", (-(-N // 8),), (32 * TC_WARPS,),
                         (w, x, null if x2 is None else x2, null if gain is None else gain, y, np.int32(M),
                          np.int32(N), np.int32(K), np.float32(self.cfg.norm_eps)), pdl=pdl)
            return
        grid = (-(-N // GEMV_WARPS), -(-M // GEMV_ROWS))
        self._launch(f"gemv_{epi}_u{self._u(K)}", grid, (32 * GEMV_WARPS,),
                     (w, x, null if x2 is None else x2, null if gain is None else gain, y, np.int32(M), np.int32(N),
                      np.int32(K), np.float32(self.cfg.norm_eps)),
                     shared_mem=4 * min(M, GEMV_ROWS) * K, pdl=pdl)

    def _qkv_rope(self, r: _Rows, w, li: int, M: int) -> None:
        """q, k, v of the norm of x + dx over M rows with RoPE, k and v into the cache (the qkv GEMV's RoPE
        epilogue)."""
        cfg, i32 = self.cfg, np.int32
        H, Hkv, D, C = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
        pairs = (H + 2 * Hkv) * (D // 2)
        ch = self._tc(M, C, paired=True) if D % 16 == 0 else 0  # a block's 8 pairs in one head
        if ch:
            self._launch(f"tgemv_rope_c{ch}", (-(-pairs // 8),), (32 * TC_WARPS,),
                         (w["qkv"], r.x, r.dx, w["n1"], r.q, self.kc[li], self.vc[li], r.meta, self.cos, self.sin,
                          i32(M), i32(H), i32(Hkv), i32(D), i32(cfg.ctx_len), i32(C), np.float32(cfg.norm_eps)))
            return
        self._launch(f"gemv_rope_u{self._u(C)}", (-(-pairs // GEMV_WARPS), -(-M // GEMV_ROWS)), (32 * GEMV_WARPS,),
                     (w["qkv"], r.x, r.dx, w["n1"], r.q, self.kc[li], self.vc[li], r.meta, self.cos, self.sin,
                      i32(M), i32(H), i32(Hkv), i32(D), i32(cfg.ctx_len), i32(C), np.float32(cfg.norm_eps)),
                     shared_mem=4 * min(M, GEMV_ROWS) * C)

    def _attend_o(self, r: _Rows, w, li: int, M: int) -> None:
        """x += dx + W_o attention(q over the cache); dx = 0 (attend_o_cluster, or attend_o)."""
        cfg, i32 = self.cfg, np.int32
        if self.attend_cluster:  # the keys split over a cluster of OSPLIT blocks, each a split of W_o's rows
            self._launch("attend_o_cluster", (M * cfg.n_heads, OSPLIT), (32 * OC_WARPS,),
                         (r.q, self.kc[li], self.vc[li], r.meta, w["o"], r.x, r.dx, i32(M), i32(cfg.n_heads),
                          i32(cfg.n_kv_heads), i32(cfg.head_dim), i32(cfg.ctx_len), i32(cfg.dim), i32(self.alone_keys)))
            return
        # row splits: up to OSPLIT while the blocks (one a multiprocessor) fit the GPU at once
        splits = OSPLIT
        while splits > 1 and splits * M * cfg.n_heads > self._n_sm:
            splits //= 2
        self._launch("attend_o", (M * cfg.n_heads, splits), (ATTEND_THREADS,),
                     (r.q, self.kc[li], self.vc[li], r.meta, w["o"], r.x, r.dx, i32(M), i32(cfg.n_heads),
                      i32(cfg.n_kv_heads), i32(cfg.head_dim), i32(cfg.ctx_len), i32(cfg.dim)),
                     shared_mem=self._attend_smem() + 4 * cfg.head_dim)

    def _swiglu_down(self, r: _Rows, w) -> None:
        """dx += W_down (silu(W_gate norm(x)) * W_up norm(x)) of one row (swiglu_down)."""
        cfg = self.cfg
        self._launch(f"swiglu_down_u{self._u(cfg.dim)}_r1", (-(-cfg.hidden // MLP_FC), 1), (32 * MLP_FC,),
                     (w["gu"], w["down"], r.x, w["n2"], r.dx, np.int32(1), np.int32(cfg.hidden), np.int32(cfg.dim),
                      np.float32(cfg.norm_eps)),
                     shared_mem=4 * (-(-cfg.dim // 4) * 4)  # x, then W_down's rows past the block's threads
                     + max(0, cfg.dim - 32 * MLP_FC) * MLP_FC * np.dtype(self.wt).itemsize)

    def _attention(self, name: str, r: _Rows, li, out, M):
        """out (M, H D): attention of the rows' q over the cache, float (`attend`) or W (`attend_act`, the
        batched path's GEMM operand)."""
        cfg = self.cfg
        args = (r.q, self.kc[li], self.vc[li], r.meta, out, np.int32(M), np.int32(cfg.n_heads),
                np.int32(cfg.n_kv_heads), np.int32(cfg.head_dim), np.int32(cfg.ctx_len))
        if self.attend_kv and M > GEMV_MAX_ROWS:
            # a block per (row, key/value head): the heads that share it read its rows once; measured slower
            # than a block per head up to 16 rows (too few blocks), faster from 64 (BENCHMARKS.md)
            G = cfg.n_heads // cfg.n_kv_heads
            self._launch(name.replace("attend", "attend_kv"), (M, cfg.n_kv_heads), (32 * KV_WARPS,), args,
                         shared_mem=4 * G * self._kv_groups * (cfg.head_dim + 2))
        else:
            self._launch(name, (M, cfg.n_heads), (ATTEND_THREADS,), args, shared_mem=self._attend_smem())

    def _attend_smem(self) -> int:
        """decode.cu's attend_row: the scores, then the partial outputs in two rounds."""
        vec = 8 if self.dtype == "bf16" else 4
        return 4 * (self.cfg.ctx_len + ATTEND_THREADS * (vec + 1))

    def _layers(self, r: _Rows, M: int, batched: bool, prefill: bool = False):
        """Every layer over M rows: r.x holds the embeddings in, the residual stream out. `prefill`: the rows
        are positions 0..M-1 of one slot (the batched path then attends with the FlashAttention)."""
        from nanoeuler.kernels.cublas import Matrix

        cfg = self.cfg
        C, H, Hkv, D, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
        HD = H * D
        i32, f32 = np.int32, np.float32
        x = r.x[:M]
        flash_ops = r.flash_operands(self.cp, cfg, self.wt) if prefill and batched and self._flash else None
        null = np.uint64(0)
        for li, w in enumerate(self.layers):
            if not batched and M == 1:  # x + dx out (dx: the last layer's MLP branch)
                self._qkv_rope(r, w, li, M)
                self._attend_o(r, w, li, M)
                self._swiglu_down(r, w)
                continue
            if not batched:  # dx stays zero
                self._qkv_rope(r, w, li, M)
                self._attention("attend", r, li, r.att, M)
                self._gemv("add", w["o"], r.att, None, None, x, M, C, HD)
                self._gemv("swiglu", w["gu"], x, None, w["n2"], r.m, M, F, C)
                self._gemv("add", w["down"], r.m, None, None, x, M, C, F)
                continue
            gemm = self.gemm()
            self._launch("rmsnorm_act", (M,), (256,), (x, w["n1"], r.act, i32(C), f32(cfg.norm_eps)))
            gemm(Matrix(r.qkv[:M]), Matrix(r.act2(M, C)), Matrix(w["qkv"]), tb=True)
            qh, kh, vh = flash_ops[:3] if flash_ops else (null, null, null)
            self._launch("rope_cache", (M,), (256,), (r.qkv, r.meta, r.q, self.kc[li], self.vc[li], self.cos,
                                                      self.sin, qh, kh, vh, i32(M), i32(H), i32(Hkv), i32(D),
                                                      i32(cfg.ctx_len)))
            if flash_ops:
                from nanoeuler.kernels.bf16 import flash

                flash.flash_fwd(self._flash, *flash_ops[:3], r.act, flash_ops[3])
            else:
                self._attention("attend_act", r, li, r.act, M)
            gemm(Matrix(x), Matrix(r.act2(M, HD)), Matrix(w["o"]), tb=True, beta=1.0)
            self._launch("rmsnorm_act", (M,), (256,), (x, w["n2"], r.act, i32(C), f32(cfg.norm_eps)))
            gemm(Matrix(r.gu[:M]), Matrix(r.act2(M, C)), Matrix(w["gu"]), tb=True)
            self._launch("swiglu_act", (M,), (256,), (r.gu, r.act, i32(F)))
            gemm(Matrix(x), Matrix(r.act2(M, F)), Matrix(w["down"]), tb=True, beta=1.0)

    def _head_logits(self, x, dx, logits, M: int, n: int, pdl: bool = True) -> None:
        """The first n rows of the stacked heads (n / V heads) on the final norm of M rows of x + dx, packed
        (M, n); two rows a warp (each x value read feeds two weights) where n is even."""
        if n % 2 == 0:
            self._gemv("store2", self.heads, x, dx, self.norm, logits, M, n // 2, self.cfg.dim, pdl=pdl)
        else:
            self._gemv("store", self.heads, x, dx, self.norm, logits, M, n, self.cfg.dim, pdl=pdl)

    def _embed(self, r: _Rows, M: int) -> None:
        self._launch("embed", (M,), (256,), (r.meta, self.emb, r.x, r.dx, np.int32(M), np.int32(self.cfg.dim)))

    def _step(self, r: _Rows, M: int, n_heads: int, rule: str):
        """Queue one forward of M rows (ids/slots/positions in r.meta) and the choice of the next ids."""
        cfg, V = self.cfg, self.cfg.vocab_size
        self._embed(r, M)
        self._layers(r, M, batched=M > GEMV_MAX_ROWS)
        if M > GEMV_MAX_ROWS:  # many rows: the heads as a GEMM on the final norm
            from nanoeuler.kernels.cublas import Matrix

            n = n_heads * V
            self._launch("rmsnorm_act", (M,), (256,), (r.x, self.norm, r.act, np.int32(cfg.dim),
                                                       np.float32(cfg.norm_eps)))
            self.gemm()(Matrix(r.logits.reshape(-1)[:M * n].reshape(M, n)), Matrix(r.act2(M, cfg.dim)),
                        Matrix(self.heads[:n]), tb=True)
        elif M == 1 and n_heads == 1 and rule in ("argmax", "chain") and V % 2 == 0 and self.fuse_argmax:
            # one row's next id: head 0 and its argmax in one kernel (the logits are not kept)
            self._launch(f"head_argmax_u{self._u(cfg.dim)}", (-(-V // 2 // GEMV_WARPS),), (32 * GEMV_WARPS,),
                         (self.heads, r.x, r.dx, self.norm, np.int32(V // 2), np.int32(cfg.dim),
                          np.float32(cfg.norm_eps), r.best, r.arrive, r.out, r.ctl, r.hist, np.int32(CHAIN_CAP),
                          np.int32(cfg.ctx_len), np.int32(rule == "chain")), shared_mem=4 * cfg.dim)
            return
        else:
            self._head_logits(r.x, r.dx, r.logits, M, n_heads * V)
        # the GEMV wrote the logits packed: (M, n_heads, V)
        if rule == "argmax":
            self._launch("argmax_rows", (M * n_heads,), (1024,), (r.logits, np.int32(V), np.int64(V), r.out))
        elif rule == "chain":  # the argmax feeds the next step (greedy_steps)
            self._launch("argmax_chain", (M,), (1024,), (r.logits, np.int32(V), r.out, r.ctl, r.hist,
                                                         np.int32(CHAIN_CAP), np.int32(cfg.ctx_len), r.arrive))
        elif rule == "accept":  # M = K rows of one slot: the next verify pass's block (greedy_passes)
            self._launch("argmax_rows", (M * n_heads,), (1024,), (r.logits, np.int32(V), np.int64(V), r.out))
            self._launch("accept_chain", (1,), (32,), (r.out, r.ctl, r.hist, np.int32(CHAIN_CAP), np.int32(M)))
        elif rule == "sample":
            self._launch("sample_rows", (M,), (1024,), (r.logits, np.int32(V), np.int64(n_heads * V), r.samp,
                                                       self.seeds, r.out))

    def _run(self, M: int, n_heads: int, rule: str, meta: np.ndarray | None = None) -> _Rows:
        """A decode step or verify pass of M rows (`_step`); see `_replay`."""
        return self._replay((M, n_heads, rule), M, lambda r: self._step(r, M, n_heads, rule), meta)

    def _replay(self, key, M: int, queue, meta: np.ndarray | None = None) -> _Rows:
        """Copy in the rows' meta (`meta`, or what is already in the host buffer), then `_execute`
        queue(rows)."""
        r = self._buffers(M)
        if meta is not None:
            r.ctl_host[:3 * M] = meta
        with self.stream:
            r.ctl.data.copy_from_host_async(r.ctl_host.ctypes.data, r.ctl_host.nbytes, self.stream)
        self._execute(key, lambda: queue(r))
        return r

    def _execute(self, key, queue) -> None:
        """Run queue() on the backend's stream: kernel by kernel the first time for `key` (compiling
        kernels, letting cuBLAS pick its algorithms), recorded as a CUDA graph the second, and replayed
        from then on."""
        state = self._graphs.get(key)
        with self.stream:
            if state is None or not self.use_graphs:
                queue()
                self._graphs[key] = "seen"
                return
            if state == "seen":
                self.stream.synchronize()
                self.stream.begin_capture()
                try:
                    queue()
                finally:
                    state = self._graphs[key] = self.stream.end_capture()
            state.launch(self.stream)

    def _fetch(self, r: _Rows, n: int) -> np.ndarray:
        with self.stream:
            r.out[:n].data.copy_to_host_async(r.out_host.ctypes.data, 4 * n, self.stream)
        self.stream.synchronize()
        return r.out_host[:n].copy()

    # ---- the backend interface --------------------------------------------------------------------------

    def prefill(self, slot: int, ids) -> np.ndarray:
        cfg = self.cfg
        T = len(ids)
        short = T <= GEMV_MAX_ROWS  # the GEMV path, float activations; else cuBLAS and the FlashAttention
        P = T if short else min(cfg.ctx_len, 1 << (T - 1).bit_length())  # longer: rows by powers of two
        ids = np.concatenate([np.asarray(ids, np.int32), np.zeros(P - T, np.int32)])
        meta = np.concatenate([ids, np.full(P, slot, np.int32), np.arange(P, dtype=np.int32)])

        def queue(r):
            self._embed(r, P)
            self._layers(r, P, batched=not short, prefill=True)

        r = self._replay(("prefill", P), P, queue, meta)
        with self.stream:  # every head at the prompt's last row; launched plainly after the graph
            self._head_logits(r.x[T - 1:T], r.dx[T - 1:T], r.logits, 1, cfg.mtp_heads * cfg.vocab_size, pdl=False)
            logits = r.logits[0].get(stream=self.stream)
        return logits.reshape(cfg.mtp_heads, cfg.vocab_size)

    def prefill_many(self, slots, prompts) -> np.ndarray:
        """`prefill` of several slots in one go: (len(slots), K, V). All prompts' rows go through the model
        together, in chunks of up to ctx_len rows in prompt order (a row attends to its own slot's cache up
        to its position, which its prompt's earlier rows, in this chunk or one before, have written); a
        chunk is padded to a power of two with copies of its last row (the same cache row written twice
        with the same values), so its graph serves every later chunk of that size."""
        if len(prompts) == 1:
            return self.prefill(slots[0], prompts[0])[None]
        cp, cfg = self.cp, self.cfg
        lens = [len(p) for p in prompts]
        ids = np.concatenate([np.asarray(p, np.int32) for p in prompts])
        slot = np.repeat(np.asarray(slots, np.int32), lens)
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
        last = np.cumsum(lens) - 1  # each prompt's last row
        xl = cp.zeros((len(prompts), cfg.dim), cp.float32)
        dxl = cp.zeros_like(xl)
        for c0 in range(0, len(ids), cfg.ctx_len):
            c1 = min(len(ids), c0 + cfg.ctx_len)
            T = c1 - c0
            P = T if T <= GEMV_MAX_ROWS else 1 << (T - 1).bit_length()
            pad = lambda a: np.concatenate([a[c0:c1], np.full(P - T, a[c1 - 1], np.int32)])  # noqa: E731
            batched = P > GEMV_MAX_ROWS

            def queue(r, P=P, batched=batched):
                self._embed(r, P)
                self._layers(r, P, batched=batched)

            r = self._replay(("prefill_many", P), P, queue, np.concatenate([pad(ids), pad(slot), pad(pos)]))
            done = np.flatnonzero((last >= c0) & (last < c1))
            if len(done):
                with self.stream:
                    rows = cp.asarray(last[done] - c0)
                    xl[cp.asarray(done)] = r.x[rows]
                    dxl[cp.asarray(done)] = r.dx[rows]
        n = cfg.mtp_heads * cfg.vocab_size
        logits = cp.zeros((len(prompts), n), cp.float32)
        with self.stream:  # every head at each prompt's last row; launched plainly after the graphs
            self._head_logits(xl, dxl, logits, len(prompts), n, pdl=False)
            out = logits.get(stream=self.stream)
        return out.reshape(len(prompts), cfg.mtp_heads, cfg.vocab_size)

    def decode(self, tokens, pos, sampling, step, rngs, mask) -> np.ndarray:
        B = len(tokens)
        greedy = sampling.temperature <= 0
        r = self._buffers(B)
        h = r.ctl_host
        h[:B] = tokens
        h[B:2 * B] = r.slots
        h[2 * B:3 * B] = pos
        if not greedy:
            h[3 * B:3 * B + 2] = (sampling.top_k, step & 0x7FFFFFFF)
            h[3 * B + 2:] = np.array([sampling.temperature, sampling.top_p], dtype=np.float32).view(np.int32)
        self._run(B, 1, "argmax" if greedy else "sample")
        return self._fetch(r, B)

    def decode_logits(self, tokens, pos, mask):
        """`decode`'s forward without the choice: head-0 logits of the rows in `mask`, (n, V) float32, left on
        the device (the server's log-probabilities and grammar masks reduce them there)."""
        cp, B, V = self.cp, len(tokens), self.cfg.vocab_size
        r = self._buffers(B)
        h = r.ctl_host
        h[:B], h[B:2 * B], h[2 * B:3 * B] = tokens, r.slots, pos
        self._run(B, 1, "logits")  # no rule: the forward and head 0 only
        with self.stream:
            out = r.logits.reshape(-1)[:B * V].reshape(B, V)[cp.asarray(np.flatnonzero(mask))]
        self.stream.synchronize()
        return out

    def prefill_from(self, slot: int, ids, start: int) -> np.ndarray:
        """`prefill` of a slot whose cache already holds ids[:start] (`write_rows`): only ids[start:] are fed, at
        their positions, as one `prefill_many` chunk (attending to the slot's cache; padded with copies of the
        last row, which rewrite its cache row with the same values). (K, V)."""
        cfg = self.cfg
        ids = np.asarray(ids, np.int32)
        T = len(ids) - start
        P = T if T <= GEMV_MAX_ROWS else 1 << (T - 1).bit_length()
        pad = lambda a: np.concatenate([a, np.full(P - T, a[-1], np.int32)])  # noqa: E731
        meta = np.concatenate([pad(ids[start:]), np.full(P, slot, np.int32),
                               pad(np.arange(start, len(ids), dtype=np.int32))])

        def queue(r):
            self._embed(r, P)
            self._layers(r, P, batched=P > GEMV_MAX_ROWS)

        r = self._replay(("prefill_many", P), P, queue, meta)  # the same work as prefill_many's chunk of P rows
        with self.stream:
            self._head_logits(r.x[T - 1:T], r.dx[T - 1:T], r.logits, 1, cfg.mtp_heads * cfg.vocab_size, pdl=False)
            logits = r.logits[0].get(stream=self.stream)
        return logits.reshape(cfg.mtp_heads, cfg.vocab_size)

    def read_rows(self, slot: int, n: int):
        """A copy (on the device) of the first `n` positions of a slot's cache, every layer's keys and values."""
        with self.stream:
            return self.kc[:, slot, :, :n].copy(), self.vc[:, slot, :, :n].copy()

    def write_rows(self, slot: int, rows, n: int) -> None:
        """Put the first `n` positions of `read_rows`' copy into a slot's cache."""
        k, v = rows
        with self.stream:
            self.kc[:, slot, :, :n] = k[:, :, :n]
            self.vc[:, slot, :, :n] = v[:, :, :n]

    def greedy_steps(self, tokens, pos, n: int):
        """Greedy decoding of every slot of the batch, from tokens fed at positions pos (one each): yields
        the next ids (one per slot) n times. The step's graph feeds itself (argmax_chain), so the host
        queues up to CHAIN_AHEAD steps ahead and reads each step's ids as they land; steps queued past a
        row's end only write cache rows that later steps overwrite (positions stay below the context
        length). The caller keeps the rows it needs inside the context."""
        M = len(tokens)
        r = self._buffers(M)
        r.ctl_host[:M] = tokens
        r.ctl_host[M:2 * M] = r.slots
        r.ctl_host[2 * M:3 * M] = pos
        r.ctl_host[3 * M + 1] = 0  # the step counter
        with self.stream:
            r.ctl.data.copy_from_host_async(r.ctl_host.ctypes.data, r.ctl_host.nbytes, self.stream)
        yield from self._chained(r, (M, 1, "chain"), lambda: self._step(r, M, 1, "chain"), M,
                                 lambda queued, read: queued < n)

    def _chained(self, r: _Rows, key, queue, size: int, more):
        """Queue steps that feed themselves while more(queued, read) and fewer than CHAIN_AHEAD are unread;
        yield each step's record (`size` ids of r.hist's ring) as it lands."""
        queued = read = 0
        while True:
            while queued - read < CHAIN_AHEAD and more(queued, read):
                self._execute(key, queue)
                with self.stream:
                    self._landed[queued % CHAIN_CAP].record(self.stream)
                queued += 1
            if queued == read:
                return
            j = read % CHAIN_CAP
            self._landed[j].synchronize()
            read += 1
            yield r.hist_host[j * size:(j + 1) * size].copy()

    def greedy_passes(self, sure: int, drafts, pos: int):
        """Greedy self-speculative verify passes of slot 0 that feed themselves (accept_chain), from the
        block [sure] + drafts fed at pos: yields (a, block, ids) per pass, a the drafts kept, ids the K heads'
        argmax after the last kept row (the next sure token and drafts). The host queues up to CHAIN_AHEAD
        passes ahead, only those sure to end inside the context (a pass moves on by 1 to K positions);
        it stops when no more are."""
        K, ctx = self.cfg.mtp_heads, self.cfg.ctx_len
        r = self._buffers(K)
        r.ctl_host[:K] = [sure] + list(drafts)
        r.ctl_host[K:2 * K] = 0
        r.ctl_host[2 * K:3 * K] = pos + np.arange(K)
        r.ctl_host[3 * K + 1] = 0  # the pass counter
        with self.stream:
            r.ctl.data.copy_from_host_async(r.ctl_host.ctypes.data, r.ctl_host.nbytes, self.stream)
        start = [pos]  # the first unread pass's position
        for got in self._chained(r, (K, K, "accept"), lambda: self._step(r, K, K, "accept"), 2 * K + 1,
                                 lambda queued, read: start[0] + K * (queued - read + 1) <= ctx):
            a = int(got[0])
            start[0] += a + 1
            yield a, got[1:K + 1], got[K + 1:]

    def verify_argmax(self, tokens, pos: int) -> np.ndarray:
        t = len(tokens)
        K = self.cfg.mtp_heads
        meta = np.concatenate([np.asarray(tokens, np.int32), np.zeros(t, np.int32),
                               pos + np.arange(t, dtype=np.int32)])
        r = self._run(t, K, "argmax", meta)
        return self._fetch(r, t * K).reshape(t, K).T  # (K, t)

    def verify(self, tokens, pos: int) -> np.ndarray:
        t = len(tokens)
        cfg = self.cfg
        meta = np.concatenate([np.asarray(tokens, np.int32), np.zeros(t, np.int32),
                               pos + np.arange(t, dtype=np.int32)])
        r = self._run(t, cfg.mtp_heads, "none", meta)
        with self.stream:
            logits = r.logits[:t].get(stream=self.stream)
        return logits.reshape(t, cfg.mtp_heads, cfg.vocab_size).transpose(1, 0, 2)  # (K, t, V)

