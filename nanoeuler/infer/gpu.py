"""The decode engine's GPU backend: bf16 (or float32) weights, a preallocated cache, CUDA-graph decode steps.

    >>> be = GpuBackend(params, cfg, dtype="bf16")     # params: NumPy or CuPy float32        # doctest: +SKIP
    >>> be.start(1, seeds=[0]); be.prefill(0, ids)       # (K, V) logits of the prompt's last row   # doctest: +SKIP

The model runs over rows (token, cache slot, position); see `engine.py` for the interface. This module
holds the buffers, the graphs and that interface; the kernels are `kernels/decode/`'s, each family with
its named launchers, and `kernels/decode/plan.py` chooses the variants (`self.variants`). A layer reads
like `transformer._block_forward`, one of three ways, the same arithmetic:

  * one row (batch-1 steps, `_layer_one_row`): three kernels, the qkv GEMV (the RMSNorm in its prologue,
    RoPE and the cache write in its epilogue), attention with the o projection (`attend_o.attend_o_cluster`:
    the 8 blocks of a head, a thread block cluster, each attend over an eighth of the keys and add their
    eighth of W_o's rows to x; below compute capability 9.0 `attend_o`, every block over all keys), and
    the MLP (`mlp.swiglu_down`: gate/up, silu(g) * u, and each block's share of the down projection added
    to dx, which the next layer folds into x). The branches join by atomicAdd, so float sums may differ
    in the last bits from run to run. Head 0 and the argmax are one kernel (`gemv.head_argmax`).
  * 2 to 16 rows (verify passes, small batches, short prefills, `_layer_few_rows`): five kernels, qkv,
    attention, o (+= x), gate/up (-> silu(g) * u), down (+= x); with bf16 weights the products run on the
    tensor cores (`tgemv`: mma.sync, x split into bf16 hi + lo, so the activations keep about 16 bits), else
    as float GEMVs (`gemv`). Such products are bound by the weight bandwidth and a step by its kernel
    boundaries, so every kernel requests its weights before it waits for the one before it: on compute
    capability 9.0 each is launched with programmatic dependent launch (`launch.py`) and may start while
    that one still runs.
  * many rows (prefill, wide batches, `_layer_many_rows`): cuBLAS GEMMs (bf16 operands, float32
    accumulation, through ctypes so that they can be captured) between row kernels (`elementwise`); a
    prefill's attention is the training engine's tensor-core FlashAttention (bf16, head size 32 or 64)
    over the prompt, a wide batch's a block per (row, key/value head) (`attend.attend_kv_act`: the query
    heads that share the key/value head read it once).

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

from nanoeuler.kernels.decode import Launch, attend, attend_o, elementwise, gemv, mlp, plan, sampling, tgemv
from nanoeuler.kernels.decode.plan import CHAIN_AHEAD, CHAIN_CAP, GEMV_MAX_ROWS
from nanoeuler.model.layers import rope_tables
from nanoeuler.model.transformer import head_weight_names


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
        self.meta, self.samp = self.ctl[: 3 * M], self.ctl[3 * M :]
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
        return self.act[: m * width].reshape(m, width)


class GpuBackend:
    # a verify pass's time in decode steps (measured on an H100: docs/decode-kernels-log.md)
    verify_cost = 1.4

    def __init__(self, params: dict, cfg, dtype: str = "bf16", pdl: bool | None = None):
        """`pdl`: launch with programmatic dependent launch where the GPU has it (default: on, unless the
        environment sets NANOEULER_PDL=0)."""
        import cupy as cp

        from nanoeuler.kernels.pdl import pdl_launcher

        self.cp, self.cfg, self.dtype = cp, cfg, dtype
        self.variants = plan.choose_variants(cfg, dtype, int(cp.cuda.Device().compute_capability))
        self.wt = cp.uint16 if dtype == "bf16" else cp.float32
        self.stream = cp.cuda.Stream(non_blocking=True)
        if pdl is None:
            pdl = os.environ.get("NANOEULER_PDL", "1") != "0"
        self.go = Launch(dtype, self.stream, pdl_launcher() if pdl else None)
        self.go.load()
        if self.pdl is not None:  # one launch to see that the driver takes it
            try:
                probe = cp.zeros(2, cp.int32)
                sampling.argmax_rows(self.go, probe.view(cp.float32), 1, 1, probe, 1)
                cp.cuda.Device().synchronize()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"programmatic dependent launch failed ({exc}); launching the ordinary way")
                self.go.pdl = None
        self._flash = None  # a long prefill's attention: the training engine's tensor-core kernels
        if self.variants.flash:
            from nanoeuler.kernels.bf16 import flash

            self._flash = flash.flash_kernels(self.variants.flash, cfg.head_dim)
        W = (
            (lambda a: to_bf16(cp.asarray(a, dtype=cp.float32)))
            if dtype == "bf16"
            else (lambda a: cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32)))
        )
        g32 = lambda a: cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32))  # noqa: E731
        p = params
        self.emb = W(p["embed_tokens.weight"])
        self.layers = []
        for i in range(cfg.n_layers):
            n = f"layers.{i}."
            self.layers.append(
                dict(
                    n1=g32(p[n + "input_layernorm.weight"]),
                    n2=g32(p[n + "post_attention_layernorm.weight"]),
                    qkv=W(
                        cp.concatenate(
                            [cp.asarray(p[n + f"self_attn.{w}_proj.weight"], dtype=cp.float32) for w in "qkv"]
                        )
                    ),
                    o=W(p[n + "self_attn.o_proj.weight"]),
                    gu=W(
                        cp.concatenate(
                            [cp.asarray(p[n + f"mlp.{w}_proj.weight"], dtype=cp.float32) for w in ("gate", "up")]
                        )
                    ),
                    down=W(p[n + "mlp.down_proj.weight"]),
                )
            )
        self.norm = g32(p["norm.weight"])
        cos, sin = rope_tables(cfg.ctx_len, cfg.head_dim, cfg.rope_theta, np, np.float32)  # as the reference
        self.cos, self.sin = cp.asarray(cos), cp.asarray(sin)
        self.heads = W(cp.concatenate([cp.asarray(p[h], dtype=cp.float32) for h in head_weight_names(cfg)]))
        self._n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
        self._gemm = None
        self._rows: dict[int, _Rows] = {}
        self._graphs: dict = {}
        self.kc = self.vc = None
        self.seeds = None
        self.use_graphs = True
        self._landed = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(CHAIN_CAP)]  # per record

    @property
    def pdl(self):
        """The PDL launcher the kernels go through, or None (ordinary launches)."""
        return self.go.pdl

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

    # ---- the forward over rows: each line a named launcher of kernels/decode/ --------------------------

    def _step(self, r: _Rows, M: int, n_heads: int, rule: str):
        """Queue one forward of M rows (ids/slots/positions in r.meta) and the choice of the next ids."""
        cfg, go, V = self.cfg, self.go, self.cfg.vocab_size
        self._embed(r, M)
        self._layers(r, M, batched=M > GEMV_MAX_ROWS)
        if M > GEMV_MAX_ROWS:  # many rows: the heads as a GEMM on the final norm
            from nanoeuler.kernels.cublas import Matrix

            n = n_heads * V
            elementwise.rmsnorm_act(go, r.x, self.norm, r.act, M, cfg.dim, cfg.norm_eps)
            self.gemm()(
                Matrix(r.logits.reshape(-1)[: M * n].reshape(M, n)),
                Matrix(r.act2(M, cfg.dim)),
                Matrix(self.heads[:n]),
                tb=True,
            )
        elif M == 1 and n_heads == 1 and rule in ("argmax", "chain") and V % 2 == 0 and self.variants.fuse_argmax:
            # one row's next id: head 0 and its argmax in one kernel (the logits are not kept)
            gemv.head_argmax(
                go,
                self.heads,
                r.x,
                r.dx,
                self.norm,
                V,
                cfg.dim,
                cfg.norm_eps,
                r.best,
                r.arrive,
                r.out,
                r.ctl,
                r.hist,
                CHAIN_CAP,
                cfg.ctx_len,
                rule == "chain",
            )
            return
        else:
            self._head_logits(r.x, r.dx, r.logits, M, n_heads * V)
        # the GEMV wrote the logits packed: (M, n_heads, V)
        if rule == "argmax":
            sampling.argmax_rows(go, r.logits, V, V, r.out, M * n_heads)
        elif rule == "chain":  # the argmax feeds the next step (greedy_steps)
            sampling.argmax_chain(go, r.logits, V, r.out, r.ctl, r.hist, CHAIN_CAP, cfg.ctx_len, r.arrive, M)
        elif rule == "accept":  # M = K rows of one slot: the next verify pass's block (greedy_passes)
            sampling.argmax_rows(go, r.logits, V, V, r.out, M * n_heads)
            sampling.accept_chain(go, r.out, r.ctl, r.hist, CHAIN_CAP, M)
        elif rule == "sample":
            sampling.sample_rows(go, r.logits, V, n_heads * V, r.samp, self.seeds, r.out, M)

    def _layers(self, r: _Rows, M: int, batched: bool, prefill: bool = False):
        """Every layer over M rows: r.x holds the embeddings in, the residual stream out. `prefill`: the rows
        are positions 0..M-1 of one slot (the batched path then attends with the FlashAttention)."""
        flash_ops = r.flash_operands(self.cp, self.cfg, self.wt) if prefill and batched and self._flash else None
        for li, w in enumerate(self.layers):
            if batched:
                self._layer_many_rows(r, li, w, M, flash_ops)
            elif M == 1:
                self._layer_one_row(r, li, w)
            else:
                self._layer_few_rows(r, li, w, M)

    def _layer_one_row(self, r: _Rows, li: int, w: dict) -> None:
        """`transformer._block_forward` of one row in three kernels. The stream is x + dx: dx holds the
        layer before's MLP branch, which this layer's attention kernel folds into x."""
        cfg = self.cfg
        C, H, Hkv, D, L = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ctx_len
        self._qkv_rope(r, li, w, 1)  # q = rope(q(h)), k = rope(k(h)), v(h) into the cache; h = norm1(x + dx)
        if self.variants.attend_cluster:  # x += dx + o(attention(q, cache)); dx = 0
            attend_o.attend_o_cluster(
                self.go,
                r.q,
                self.kc[li],
                self.vc[li],
                r.meta,
                w["o"],
                r.x,
                r.dx,
                1,
                H,
                Hkv,
                D,
                L,
                C,
                self.variants.alone_keys,
            )
        else:
            attend_o.attend_o(
                self.go, r.q, self.kc[li], self.vc[li], r.meta, w["o"], r.x, r.dx, 1, H, Hkv, D, L, C, self._n_sm
            )
        mlp.swiglu_down(self.go, w["gu"], w["down"], r.x, w["n2"], r.dx, cfg.hidden, C, cfg.norm_eps)  # dx = mlp(x)

    def _layer_few_rows(self, r: _Rows, li: int, w: dict, M: int) -> None:
        """`transformer._block_forward` of 2 to 16 rows in five kernels (dx stays zero)."""
        cfg, x = self.cfg, r.x[:M]
        C, H, Hkv, D, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
        self._qkv_rope(r, li, w, M)  # q = rope(q(h)), k = rope(k(h)), v(h) into the cache; h = norm1(x)
        attend.attend(self.go, r.q, self.kc[li], self.vc[li], r.meta, r.att, M, H, Hkv, D, cfg.ctx_len)  # a
        self._product("add", w["o"], r.att, None, None, x, M, C, H * D)  # x += o(a)
        self._product("swiglu", w["gu"], x, None, w["n2"], r.m, M, F, C)  # m = silu(gate(h2)) * up(h2); h2 = norm2(x)
        self._product("add", w["down"], r.m, None, None, x, M, C, F)  # x += down(m)

    def _layer_many_rows(self, r: _Rows, li: int, w: dict, M: int, flash_ops) -> None:
        """`transformer._block_forward` of many rows: cuBLAS GEMMs between row kernels."""
        from nanoeuler.kernels.cublas import Matrix

        cfg, go, gemm, x = self.cfg, self.go, self.gemm(), r.x[:M]
        C, H, Hkv, D, F, L, eps = (
            cfg.dim,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.hidden,
            cfg.ctx_len,
            cfg.norm_eps,
        )
        elementwise.rmsnorm_act(go, x, w["n1"], r.act, M, C, eps)  # h = norm1(x)
        gemm(Matrix(r.qkv[:M]), Matrix(r.act2(M, C)), Matrix(w["qkv"]), tb=True)  # q, k, v = qkv(h)
        qh, kh, vh = flash_ops[:3] if flash_ops else (None, None, None)
        elementwise.rope_cache(
            go, r.qkv, r.meta, r.q, self.kc[li], self.vc[li], self.cos, self.sin, qh, kh, vh, M, H, Hkv, D, L
        )  # q, k = rope(q), rope(k); k, v into the cache
        if flash_ops:  # a = attention(q, k, v): a prefill over its own rows
            from nanoeuler.kernels.bf16 import flash

            flash.flash_fwd(self._flash, *flash_ops[:3], r.act, flash_ops[3])
        elif self.variants.attend_kv:  # a = attention(q, cache)
            attend.attend_kv_act(go, r.q, self.kc[li], self.vc[li], r.meta, r.act, M, H, Hkv, D, L)
        else:
            attend.attend_act(go, r.q, self.kc[li], self.vc[li], r.meta, r.act, M, H, Hkv, D, L)
        gemm(Matrix(x), Matrix(r.act2(M, H * D)), Matrix(w["o"]), tb=True, beta=1.0)  # x += o(a)
        elementwise.rmsnorm_act(go, x, w["n2"], r.act, M, C, eps)  # h2 = norm2(x)
        gemm(Matrix(r.gu[:M]), Matrix(r.act2(M, C)), Matrix(w["gu"]), tb=True)  # gate, up = gu(h2)
        elementwise.swiglu_act(go, r.gu, r.act, M, F)  # m = silu(gate) * up
        gemm(Matrix(x), Matrix(r.act2(M, F)), Matrix(w["down"]), tb=True, beta=1.0)  # x += down(m)

    def _qkv_rope(self, r: _Rows, li: int, w: dict, M: int) -> None:
        """q, k, v of norm1(x + dx) over M rows, q and k rotated, k and v into the cache: the qkv product
        with RoPE in its epilogue, on the tensor cores where a block's 8 pairs lie in one head."""
        cfg = self.cfg
        H, Hkv, D, C = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
        ch = plan.tc_chunks(M, C, self.dtype, self.variants.tensor_cores, paired=True) if D % 16 == 0 else 0
        args = (
            w["qkv"],
            r.x,
            r.dx,
            w["n1"],
            r.q,
            self.kc[li],
            self.vc[li],
            r.meta,
            self.cos,
            self.sin,
            M,
            H,
            Hkv,
            D,
            cfg.ctx_len,
            C,
            cfg.norm_eps,
        )
        if ch:
            tgemv.tgemv_rope(self.go, ch, *args)
        else:
            gemv.gemv_rope(self.go, *args)

    def _product(self, epi: str, w, x, x2, gain, y, M: int, N: int, K: int, pdl: bool = True) -> None:
        """y = W norm(x + x2) over M rows (x2 and gain may be None), `epi`: store, store2, add, swiglu (as
        gemv.gemv). 2 to 16 rows of bf16 weights take the tensor-core GEMV (store2 as store)."""
        ch = plan.tc_chunks(M, K, self.dtype, self.variants.tensor_cores, paired=epi == "swiglu")
        if ch:
            if epi == "store2":
                epi, N = "store", 2 * N
            tgemv.tgemv(self.go, epi, ch, w, x, x2, gain, y, M, N, K, self.cfg.norm_eps, pdl=pdl)
        else:
            gemv.gemv(self.go, epi, w, x, x2, gain, y, M, N, K, self.cfg.norm_eps, pdl=pdl)

    def _head_logits(self, x, dx, logits, M: int, n: int, pdl: bool = True) -> None:
        """The first n rows of the stacked heads (n / V heads) on the final norm of M rows of x + dx, packed
        (M, n); two rows a warp (each x value read feeds two weights) where n is even."""
        if n % 2 == 0:
            self._product("store2", self.heads, x, dx, self.norm, logits, M, n // 2, self.cfg.dim, pdl=pdl)
        else:
            self._product("store", self.heads, x, dx, self.norm, logits, M, n, self.cfg.dim, pdl=pdl)

    def _embed(self, r: _Rows, M: int) -> None:
        elementwise.embed(self.go, r.meta, self.emb, r.x, r.dx, M, self.cfg.dim)

    def _run(self, M: int, n_heads: int, rule: str, meta: np.ndarray | None = None) -> _Rows:
        """A decode step or verify pass of M rows (`_step`); see `_replay`."""
        return self._replay((M, n_heads, rule), M, lambda r: self._step(r, M, n_heads, rule), meta)

    def _replay(self, key, M: int, queue, meta: np.ndarray | None = None) -> _Rows:
        """Copy in the rows' meta (`meta`, or what is already in the host buffer), then `_execute`
        queue(rows)."""
        r = self._buffers(M)
        if meta is not None:
            r.ctl_host[: 3 * M] = meta
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
        x, dx = self._prefill_rows(slot, ids)
        return self._last_logits(x, dx)[0]

    def prefill_many(self, slots, prompts, starts=None) -> np.ndarray:
        """`prefill` of several slots in one go: (len(slots), K, V). All prompts' rows go through the model
        together, in chunks of up to ctx_len rows in prompt order (a row attends to its own slot's cache up
        to its position, which its prompt's earlier rows, in this chunk or one before, have written); a
        chunk is padded to a power of two with copies of its last row (the same cache row written twice
        with the same values), so its graph serves every later chunk of that size. `starts`: the positions
        each slot's cache already holds (`write_rows`); only the rows after them are fed."""
        starts = list(starts) if starts is not None else [0] * len(prompts)
        if len(prompts) == 1 and not starts[0]:
            return self.prefill(slots[0], prompts[0])[None]
        return self._last_logits(*self._prefill_many_rows(slots, prompts, starts))

    def _prefill_rows(self, slot: int, ids, avoid: int = 0):
        """Queue the prefill of one slot from position 0 (the FlashAttention over its own rows past the
        few-row path): the prompt's last row of the stream (x, dx), (1, C) each. `avoid`: a row count not
        to run as (`plan.prefill_rows`)."""
        cfg = self.cfg
        T = len(ids)
        P = plan.prefill_rows(T, cfg.ctx_len, avoid)  # longer: rows by powers of two
        short = P <= GEMV_MAX_ROWS  # the GEMV path, float activations; else cuBLAS and the FlashAttention
        ids = np.concatenate([np.asarray(ids, np.int32), np.zeros(P - T, np.int32)])
        meta = np.concatenate([ids, np.full(P, slot, np.int32), np.arange(P, dtype=np.int32)])

        def queue(r):
            self._embed(r, P)
            self._layers(r, P, batched=not short, prefill=True)

        r = self._replay(("prefill", P), P, queue, meta)
        return r.x[T - 1 : T], r.dx[T - 1 : T]

    def _prefill_many_rows(self, slots, prompts, starts, avoid: int = 0):
        """Queue `prefill_many`'s passes: each prompt's last row of the stream (x, dx), (len(prompts), C)
        each, in prompt order. `avoid` as `_prefill_rows`'."""
        cp, cfg = self.cp, self.cfg
        lens = [len(p) - s for p, s in zip(prompts, starts)]
        ids = np.concatenate([np.asarray(p[s:], np.int32) for p, s in zip(prompts, starts)])
        slot = np.repeat(np.asarray(slots, np.int32), lens)
        pos = np.concatenate([np.arange(s, len(p), dtype=np.int32) for p, s in zip(prompts, starts)])
        last = np.cumsum(lens) - 1  # each prompt's last row
        parts = []  # each chunk's (x, dx) at the last rows of the prompts that end in it, in prompt order
        for c0 in range(0, len(ids), cfg.ctx_len):
            c1 = min(len(ids), c0 + cfg.ctx_len)
            T = c1 - c0
            P = plan.prefill_rows(T, cfg.ctx_len, avoid)
            pad = lambda a: np.concatenate([a[c0:c1], np.full(P - T, a[c1 - 1], np.int32)])  # noqa: E731
            batched = P > GEMV_MAX_ROWS

            def queue(r, P=P, batched=batched):
                self._embed(r, P)
                self._layers(r, P, batched=batched)

            r = self._replay(("prefill_many", P), P, queue, np.concatenate([pad(ids), pad(slot), pad(pos)]))
            ends = last[(last >= c0) & (last < c1)] - c0
            with self.stream:
                if len(ends) == 1 and c1 == len(ids):  # one prompt ends in the last chunk: its row as it lies
                    parts.append((r.x[ends[0] : ends[0] + 1], r.dx[ends[0] : ends[0] + 1]))
                elif len(ends):  # copies, since a later chunk of this size writes the same buffers
                    at = cp.asarray(ends)
                    parts.append((r.x[at], r.dx[at]))
        if len(parts) == 1:
            return parts[0]
        xs, dxs = zip(*parts)
        with self.stream:
            return cp.concatenate(xs), cp.concatenate(dxs)

    def _last_logits(self, x, dx) -> np.ndarray:
        """Every head's logits at prompts' last rows (x, dx: (n, C)), launched plainly after the graphs and
        read back: (n, K, V)."""
        cfg, n = self.cfg, len(x)
        width = cfg.mtp_heads * cfg.vocab_size
        with self.stream:
            logits = self.cp.empty((n, width), self.cp.float32)
            self._head_logits(x, dx, logits, n, width, pdl=False)
            out = logits.get(stream=self.stream)
        return out.reshape(n, cfg.mtp_heads, cfg.vocab_size)

    def decode(self, tokens, pos, sampling, step, rngs, mask) -> np.ndarray:
        B = len(tokens)
        greedy = sampling.temperature <= 0
        r = self._buffers(B)
        h = r.ctl_host
        h[:B] = tokens
        h[B : 2 * B] = r.slots
        h[2 * B : 3 * B] = pos
        if not greedy:
            h[3 * B : 3 * B + 2] = (sampling.top_k, step & 0x7FFFFFFF)
            h[3 * B + 2 :] = np.array([sampling.temperature, sampling.top_p], dtype=np.float32).view(np.int32)
        self._run(B, 1, "argmax" if greedy else "sample")
        return self._fetch(r, B)

    def decode_logits(self, tokens, pos, mask):
        """`decode`'s forward without the choice: head-0 logits of the rows in `mask`, (n, V) float32, left on
        the device (the server's log-probabilities and grammar masks reduce them there)."""
        cp, B, V = self.cp, len(tokens), self.cfg.vocab_size
        r = self._buffers(B)
        h = r.ctl_host
        h[:B], h[B : 2 * B], h[2 * B : 3 * B] = tokens, r.slots, pos
        self._run(B, 1, "logits")  # no rule: the forward and head 0 only
        with self.stream:
            out = r.logits.reshape(-1)[: B * V].reshape(B, V)[cp.asarray(np.flatnonzero(mask))]
        self.stream.synchronize()
        return out

    def prefill_from(self, slot: int, ids, start: int) -> np.ndarray:
        """`prefill` of a slot whose cache already holds ids[:start] (`write_rows`): `prefill_many`'s rows of one
        prompt from `start` on. (K, V)."""
        return self.prefill_many([slot], [ids], [start])[0]

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

    def greedy_chain(self, tokens, pos, steps: int) -> "_Chain":
        """Greedy decoding of every slot of the batch from tokens fed at positions pos (one each), up to
        `steps` steps: a `_Chain` whose `next()` gives each step's ids (one per slot). The step's graph feeds
        itself (argmax_chain), so the host queues steps ahead and reads each step's ids as they land; steps
        queued past a row's end only write cache rows that later steps overwrite (positions stay below the
        context length). The caller keeps the rows it needs inside the context, and calls nothing else on
        the backend until the chain is drained (the steps read the batch's buffers), but the chain's `join`."""
        M = len(tokens)
        r = self._buffers(M)
        r.ctl_host[:M] = tokens
        r.ctl_host[M : 2 * M] = r.slots
        r.ctl_host[2 * M : 3 * M] = pos
        r.ctl_host[3 * M + 1] = 0  # the step counter
        with self.stream:
            r.ctl.data.copy_from_host_async(r.ctl_host.ctypes.data, r.ctl_host.nbytes, self.stream)
        return _GreedyChain(self, r, steps)

    def greedy_steps(self, tokens, pos, n: int):
        """`greedy_chain`'s n steps as a generator: the next ids (one per slot), n times."""
        chain = self.greedy_chain(tokens, pos, n)
        while (ids := chain.next()) is not None:
            yield ids

    def _chained(self, r: _Rows, key, queue, size: int, more):
        """Queue steps that feed themselves while more(queued, read) (`_Chain`); yield each step's record."""
        chain = _Chain(self, r, key, queue, size, more)
        while (record := chain.next()) is not None:
            yield record

    def greedy_passes(self, sure: int, drafts, pos: int):
        """Greedy self-speculative verify passes of slot 0 that feed themselves (accept_chain), from the
        block [sure] + drafts fed at pos: yields (a, block, ids) per pass, a the drafts kept, ids the K heads'
        argmax after the last kept row (the next sure token and drafts). The host queues up to CHAIN_AHEAD
        passes ahead, only those sure to end inside the context (a pass moves on by 1 to K positions);
        it stops when no more are."""
        K, ctx = self.cfg.mtp_heads, self.cfg.ctx_len
        r = self._buffers(K)
        r.ctl_host[:K] = [sure] + list(drafts)
        r.ctl_host[K : 2 * K] = 0
        r.ctl_host[2 * K : 3 * K] = pos + np.arange(K)
        r.ctl_host[3 * K + 1] = 0  # the pass counter
        with self.stream:
            r.ctl.data.copy_from_host_async(r.ctl_host.ctypes.data, r.ctl_host.nbytes, self.stream)
        start = [pos]  # the first unread pass's position
        for got in self._chained(
            r,
            (K, K, "accept"),
            lambda: self._step(r, K, K, "accept"),
            2 * K + 1,
            lambda queued, read: start[0] + K * (queued - read + 1) <= ctx,
        ):
            a = int(got[0])
            start[0] += a + 1
            yield a, got[1 : K + 1], got[K + 1 :]

    def verify_argmax(self, tokens, pos: int) -> np.ndarray:
        t = len(tokens)
        K = self.cfg.mtp_heads
        meta = np.concatenate([np.asarray(tokens, np.int32), np.zeros(t, np.int32), pos + np.arange(t, dtype=np.int32)])
        r = self._run(t, K, "argmax", meta)
        return self._fetch(r, t * K).reshape(t, K).T  # (K, t)

    def verify_argmax_many(self, slots, blocks, pos) -> np.ndarray:
        """`verify_argmax` of several slots in one pass (the server's batched speculation): blocks (n, t), row i
        fed to slots[i] at pos[i]..pos[i]+t-1 -> (n, K, t) argmax ids. One forward of n * t rows, as
        `prefill_many`'s rows of several slots (each attends to its own slot up to its position)."""
        blocks = np.asarray(blocks, np.int32)
        n, t = blocks.shape
        K = self.cfg.mtp_heads
        meta = np.concatenate(
            [
                blocks.reshape(-1),
                np.repeat(np.asarray(slots, np.int32), t),
                (np.asarray(pos, np.int32)[:, None] + np.arange(t, dtype=np.int32)).reshape(-1),
            ]
        )
        r = self._run(n * t, K, "argmax", meta)
        return self._fetch(r, n * t * K).reshape(n, t, K).transpose(0, 2, 1)

    def verify(self, tokens, pos: int) -> np.ndarray:
        t = len(tokens)
        cfg = self.cfg
        meta = np.concatenate([np.asarray(tokens, np.int32), np.zeros(t, np.int32), pos + np.arange(t, dtype=np.int32)])
        r = self._run(t, cfg.mtp_heads, "none", meta)
        with self.stream:
            logits = r.logits[:t].get(stream=self.stream)
        return logits.reshape(t, cfg.mtp_heads, cfg.vocab_size).transpose(1, 0, 2)  # (K, t, V)


class _Chain:
    """Steps that feed themselves on the GPU (`greedy_chain`, `greedy_passes`), queued while
    more(queued, read) and fewer than CHAIN_AHEAD are unread. `next()` gives the oldest unread step's record
    (`size` ids of the rows' ring, r.hist), waiting for it to land, or None when no step is left; `ready()`
    says whether it has landed already; `fill()` queues up to CHAIN_AHEAD again (a caller that reads and
    then works on the host calls it between the two, so the GPU runs on meanwhile); `stop()` queues no more."""

    def __init__(self, be: GpuBackend, r: _Rows, key, queue, size: int, more):
        self.be, self.r, self.key, self.queue, self.size, self.more = be, r, key, queue, size, more
        self.queued = self.read = 0

    def fill(self) -> None:
        be = self.be
        while self.queued - self.read < CHAIN_AHEAD and self.more(self.queued, self.read):
            be._execute(self.key, self.queue)
            with be.stream:
                be._landed[self.queued % CHAIN_CAP].record(be.stream)
            self.queued += 1

    def ready(self) -> bool:
        return self.read < self.queued and self.be._landed[self.read % CHAIN_CAP].done

    def left(self) -> bool:
        """Whether `next()` has a step to give (queued, or still to queue)."""
        return self.read < self.queued or bool(self.more(self.queued, self.read))

    def stop(self) -> None:
        self.more = lambda queued, read: False

    def next(self) -> np.ndarray | None:
        self.fill()
        if self.read == self.queued:
            return None
        j = self.read % CHAIN_CAP
        self.be._landed[j].synchronize()
        self.read += 1
        return self.r.hist_host[j * self.size : (j + 1) * self.size].copy()


class _GreedyChain(_Chain):
    """`greedy_chain`'s steps over the rows of r (one a slot), at most `steps` of them; a new stream may
    `join` it in a row whose own stream has ended, without the chain stopping."""

    def __init__(self, be: GpuBackend, r: _Rows, steps: int):
        M = self.width = r.M
        self.steps = steps
        super().__init__(be, r, (M, 1, "chain"), lambda: be._step(r, M, 1, "chain"), M, lambda q, _: q < self.steps)
        self._joins: dict[int, object] = {}  # slot -> the event after its join

    def join(self, slot: int, ids, start: int) -> int:
        """Queue the prefill of `slot` (its cache holding ids[:start]) behind the steps queued so far; its
        next id, chosen on the device (head 0's argmax), is fed to row `slot` at position len(ids) by every
        step queued from now on. Returns that first step's number; `joined(slot)` gives the id."""
        be, r, M = self.be, self.r, self.width
        if slot in self._joins:  # a stream that joined there and left unfed: its copies from ctl_host first
            self._joins.pop(slot).synchronize()
        # the pass runs in buffers of its own row count, never the chain's (M)
        x, dx = be._prefill_many_rows([slot], [ids], [start], M) if start else be._prefill_rows(slot, ids, M)
        V = be.cfg.vocab_size
        with be.stream:
            logits = be.cp.empty((1, V), be.cp.float32)
            be._head_logits(x, dx, logits, 1, V, pdl=False)
            sampling.argmax_rows(be.go, logits, V, V, r.ctl[slot : slot + 1], 1)  # the row's next input
            r.ctl_host[2 * M + slot] = len(ids)  # and its position (the host buffer is pinned)
            r.ctl[2 * M + slot : 2 * M + slot + 1].data.copy_from_host_async(
                r.ctl_host[2 * M + slot :].ctypes.data, 4, be.stream
            )
            r.ctl[slot : slot + 1].data.copy_to_host_async(r.ctl_host[slot:].ctypes.data, 4, be.stream)
            event = self._joins[slot] = be.cp.cuda.Event(block=False, disable_timing=True)
            event.record(be.stream)
        return self.queued

    def joined(self, slot: int) -> int:
        """The first id of the stream that joined at `slot` (waiting for its prefill, where it has not landed)."""
        self._joins.pop(slot).synchronize()
        return int(self.r.ctl_host[slot])

    def next(self) -> np.ndarray | None:
        ids = super().next()
        if ids is None:  # drained: every join's copies done before ctl_host serves another chain or step
            for event in self._joins.values():
                event.synchronize()
        return ids
