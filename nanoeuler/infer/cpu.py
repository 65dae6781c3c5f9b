"""The decode engine's NumPy backend: the model's arithmetic on rows of (slot, position), with a
preallocated cache.

    >>> be = CpuBackend(params, cfg, threads=2)   # params: NumPy float32 (float64: exact)       # doctest: +SKIP
    >>> be.start(batch=2, seeds=[0, 1]); be.prefill(0, [5, 17, 42]).shape                          # doctest: +SKIP
    (4, 512)

Same layers as `transformer.forward_step` (`model.layers` is the reference): the weights are stacked once at
load (q/k/v into one matrix, gate/up into one, the K output heads into one), each stored as the contiguous
(in, out) matrix that `x @ w` streams, the RoPE angles of every position are tabulated once, and the cache
(slots, Hkv, ctx_len, D) per layer is allocated once per `start`. Rows of one call may sit at different
positions of different slots (ragged batches); each attends to its own slot's keys up to its position.

Each norm's gain is folded into the matrix that reads the norm ((xhat * g) @ w == xhat @ (g[:, None] * w)),
which leaves a norm two NumPy calls on a row; a decode step of a small model is mostly such calls.

Threads. A decode step is a chain of matrix-vector products that must stream every weight once: memory
bound. On a quiet machine two cores stream faster than one; on a busy one a BLAS thread pool waits for a
second free core at every product and a step runs several times slower. So one-row steps run on the
thread count that this backend measures to be faster (`StepThreads`), other short calls (verify passes,
batched steps) on one thread. A long prefill (compute bound) is split by rows among `threads` workers
(default: the usable cores), each feeding its share through every layer with one-thread BLAS
(`_rows_long`): the element-wise NumPy work runs on every core too, not only the matrix products, and
causal attention is computed in chunks of query rows over the keys before them. BENCHMARKS.md (CPU
generation) has the measurements.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from nanoeuler.infer.sampling import sample_token
from nanoeuler.model import layers
from nanoeuler.model.transformer import head_weight_names

THREADED_MACS = 1 << 23  # a call whose rows x dim x dim reach this runs BLAS on `threads` (a prefill)
STEP_THREADS_BYTES = 64 << 20  # a step streaming fewer weight bytes stays on one thread (`StepThreads`)
PER_ROW = 3  # up to this many rows, one vector product a row beats OpenBLAS's small-M matrix product
LONG_ROWS = 64  # one-slot calls of this many rows or more take `_rows_long`
WORKER_ROWS = 32  # ... on a worker per this many rows, up to `threads`
ATT_ROWS = 64  # query rows whose scores over a prefill's keys are computed at once (they stay in cache)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class _BlasThreads:
    """Sets the thread count of the OpenBLAS that NumPy uses, through its C API (a no-op elsewhere).

    NumPy has no call for it; the library is found among the process's mapped files (Linux), since
    NumPy's wheels bundle OpenBLAS under a mangled name (symbols `scipy_openblas_*64_`)."""

    _NAMES = (
        "scipy_openblas_set_num_threads64_",
        "scipy_openblas_set_num_threads",
        "openblas_set_num_threads64_",
        "openblas_set_num_threads",
    )

    def __init__(self):
        self._set = self._get = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
        except OSError:
            return
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for name in self._NAMES:
                if hasattr(lib, name):
                    self._set = getattr(lib, name)
                    self._set.argtypes, self._set.restype = [ctypes.c_int], None
                    getter = getattr(lib, name.replace("set_", "get_"), None)
                    if getter is not None:
                        getter.argtypes, getter.restype = [], ctypes.c_int
                    self._get = getter
                    return

    def __call__(self, n: int) -> int:
        """Set n threads; return the count before (0 where unknown)."""
        if self._set is None:
            return 0
        before = self._get() if self._get is not None else 0
        if before != n:
            self._set(n)
        return before


blas_threads = _BlasThreads()


def _mm(x, w):
    """x (N, in) @ w (in, out), w C-contiguous. One row is a vector product (BLAS's GEMV; a (1, in) matrix
    would go to its slower matrix-matrix path); two or three rows one at a time; more, one matrix product."""
    n = x.shape[0]
    if n == 1:
        return (x[0] @ w)[None]
    if n <= PER_ROW:
        return np.stack([row @ w for row in x])
    return x @ w


def _rmsnorm(x, eps):
    """`layers.rmsnorm_forward`'s output before its gain (folded into the next matrix)."""
    r = np.einsum("nc,nc->n", x, x)
    r *= 1.0 / x.shape[-1]
    r += eps
    np.sqrt(r, out=r)
    return x / r[:, None]


def _silu_mul(g, u):
    """silu(g) * u in the tanh form of `layers._sigmoid` (no overflow in either tail), in place of g:
    silu(g) = h * (1 + tanh(h)) with h = g / 2."""
    g *= 0.5
    t = np.tanh(g)
    t += 1.0
    g *= t
    g *= u
    return g


def _fold(gain, w):
    """(w's input scaled by gain): the (in, out) matrix w with row i times gain[i], contiguous."""
    return np.ascontiguousarray(gain[:, None] * w)


def _step_blas(method):
    """Run a backend call with BLAS on `self.step_threads` threads (its long prefills raise it), restoring
    the caller's count after."""

    def call(self, *args, **kwargs):
        before = blas_threads(self.step_threads)
        try:
            return method(self, *args, **kwargs)
        finally:
            if before:
                blas_threads(before)

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class StepThreads:
    """The BLAS thread count of one-row steps, chosen by timing them: streaming the weights on two cores
    beats one on a quiet machine (BENCHMARKS.md), but on a busy one each product waits for a second free
    core and a step runs several times slower. So steps run on the count measured faster; every `interval`
    steps one step tries the other count, which takes over only if clearly faster (WIN). A try that loses
    makes the next one wait four times longer (up to MAX_INTERVAL steps), so on a busy machine the tries
    cost a few steps in a run, not a share of them. On several threads, two steps in a row twice as slow
    as the running mean (the machine got busy) make one thread try at once.

        >>> t = StepThreads(2); [t.pick() for _ in range(3)]
        [1, 1, 1]
    """

    FIRST, WIN, MAX_INTERVAL = 4, 0.9, 1024

    def __init__(self, threads: int):
        self.options = [1, threads] if threads > 1 else [1]
        self.cur, self.mean = 0, None  # the chosen option and its running mean seconds a step
        self.left = self.FIRST  # steps before the next try
        self.interval = 16
        self.trying = False
        self.slow = 0  # steps in a row twice as slow as the mean

    def pick(self) -> int:
        return self.options[1 - self.cur if self.trying else self.cur]

    def record(self, seconds: float) -> None:
        if self.trying:
            self.trying = False
            if seconds < self.WIN * self.mean:  # the other count wins
                self.cur, self.mean, self.interval = 1 - self.cur, seconds, 32
            else:
                self.interval = min(4 * self.interval, self.MAX_INTERVAL)
            self.left = self.interval
            return
        threaded = self.options[self.cur] > 1
        self.slow = self.slow + 1 if threaded and self.mean is not None and seconds > 2 * self.mean else 0
        self.mean = seconds if self.mean is None else 0.75 * self.mean + 0.25 * seconds
        self.left -= 1
        if (self.left <= 0 or self.slow >= 2) and len(self.options) > 1:
            self.trying, self.slow = True, 0


class CpuBackend:
    # a verify pass's time in decode steps, before a run has measured its own (engine.py's adaptive rule)
    verify_cost = 2.6

    def __init__(self, params: dict, cfg, threads: int | None = None):
        p = {k: np.asarray(v) for k, v in params.items()}
        self.cfg = cfg
        self.threads = max(1, int(threads or usable_cores()))
        self.step_threads = 1  # BLAS threads of the call in progress (short calls: memory bound)
        self.dtype = p["lm_head.weight"].dtype
        self.emb = p["embed_tokens.weight"]
        self.layers = []
        # attention's 1/sqrt(D) folded into q's rows (a score is q . k; RoPE is linear, so before it is the same)
        q_scale = 1.0 / math.sqrt(cfg.head_dim)
        for i in range(cfg.n_layers):
            g = lambda n: p[f"layers.{i}.{n}"]  # noqa: E731
            self.layers.append(
                dict(
                    qkv_t=_fold(
                        g("input_layernorm.weight"),
                        np.concatenate(
                            [
                                g("self_attn.q_proj.weight") * q_scale,
                                g("self_attn.k_proj.weight"),
                                g("self_attn.v_proj.weight"),
                            ]
                        ).T,
                    ),
                    o_t=np.ascontiguousarray(g("self_attn.o_proj.weight").T),
                    gu_t=_fold(
                        g("post_attention_layernorm.weight"),
                        np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]).T,
                    ),
                    down_t=np.ascontiguousarray(g("mlp.down_proj.weight").T),
                )
            )
        names = head_weight_names(cfg)
        # head 0 alone for plain steps (a contiguous quarter of the heads' bytes); all K for verify passes
        self.head0_t = _fold(p["norm.weight"], p[names[0]].T)  # (C, V)
        self.heads_t = _fold(p["norm.weight"], np.concatenate([p[n] for n in names]).T)  # (C, K*V)
        cos, sin = layers.rope_tables(cfg.ctx_len, cfg.head_dim, cfg.rope_theta, np, self.dtype)
        self.cos, self.sin = cos, sin  # (ctx_len, D/2)
        # -inf where key j of a chunk of query rows lies after row i (`_attend_causal`)
        self.later = np.triu(np.full((ATT_ROWS, ATT_ROWS), -np.inf, dtype=self.dtype), 1)
        self.ones = np.ones(cfg.ctx_len, dtype=self.dtype)
        self.pool = None  # workers of long calls, made at the first (`_rows_long`)
        self.k = self.v = None
        # one-row steps on a thread count chosen by timing them, where a step's weights are too big for the
        # caches (a small model's step is mostly Python: threads would only add hand-offs)
        step_bytes = sum(w.nbytes for lay in self.layers for w in lay.values()) + self.head0_t.nbytes
        self.tuner = StepThreads(self.threads if step_bytes >= STEP_THREADS_BYTES else 1)

    def start(self, batch: int, seeds=None) -> None:
        cfg = self.cfg
        shape = (batch, cfg.n_kv_heads, cfg.ctx_len, cfg.head_dim)
        if self.k is None or self.k[0].shape != shape:
            self.k = [np.zeros(shape, dtype=self.dtype) for _ in range(cfg.n_layers)]
            self.v = [np.zeros(shape, dtype=self.dtype) for _ in range(cfg.n_layers)]

    # ---- the forward over rows ---------------------------------------------------------------------

    @staticmethod
    def _rope(x, cos, sin):
        """x (N, heads, D); cos/sin (N, 1, D/2)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _attend(self, q, li, slots, pos, slot):
        """q (N,H,D) of rows at (slot, pos) -> (N, H*D), over keys 0..pos of each row's slot. `slot`: the
        one slot of all rows, or None (rows of several slots)."""
        N, H, D = q.shape
        Hkv, G = self.cfg.n_kv_heads, self.cfg.group
        S = int(pos.max()) + 1
        if slot is None:
            # several slots: each row's keys gathered; einsum's own loops (a stack of tiny products)
            k, v = self.k[li][slots, :, :S], self.v[li][slots, :, :S]  # (N,Hkv,S,D)
            s = np.einsum("nhgd,nhsd->nhgs", q.reshape(N, Hkv, G, D), k)  # (N,Hkv,G,S)
            if S > 1:
                s += np.where(np.arange(S)[None, :] > pos[:, None], -np.inf, 0.0).astype(s.dtype)[:, None, None]
            return np.einsum("nhgs,nhsd->nhgd", self._softmax(s), v).reshape(N, H * D)
        # one slot (a decode step, a verify pass, a prefill): the cache's own rows, no copy; the
        # rows' query heads of one key head stacked into one (N*G, D) @ (D, S) product per key head
        k, v = self.k[li][slot, :, :S], self.v[li][slot, :, :S]  # (Hkv,S,D) views
        qh = q.reshape(N, Hkv, G, D).transpose(1, 0, 2, 3).reshape(Hkv, N * G, D)
        s = (qh @ k.transpose(0, 2, 1)).reshape(Hkv, N, G, S)
        if N > 1:  # a single row sits at S - 1 and sees every key
            s += np.where(np.arange(S)[None, :] > pos[:, None], -np.inf, 0.0).astype(s.dtype)[None, :, None]
        o = self._softmax(s).reshape(Hkv, N * G, S) @ v  # (Hkv, N*G, D)
        return o.reshape(Hkv, N, G, D).transpose(1, 0, 2, 3).reshape(N, H * D)

    @staticmethod
    def _softmax(s):
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        return s

    def _rows(self, ids, slots, pos, slot=None):
        """Feed rows: ids, slots, pos (N,) -> final normed states (N, C), before the output heads' (folded)
        gain. Writes each row's k/v at (slot, pos). `slot`: the slot of every row where they share one."""
        cfg = self.cfg
        N = ids.shape[0]
        if slot is not None and N >= LONG_ROWS and np.array_equal(pos, pos[0] + np.arange(N)):
            return _rmsnorm(self._rows_long(ids, int(pos[0]), slot), cfg.norm_eps)
        one = N == 1 and slot is not None
        if N * cfg.dim * cfg.dim >= THREADED_MACS:
            blas_threads(self.threads)
        x = self.emb[ids]  # (N,C), a copy: updated in place below
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # (N,1,D/2)
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, cos, sin)
            if one:  # plain indexing: a decode step's write is one row per key head
                self.k[li][slot, :, pos[0]] = k[0]
                self.v[li][slot, :, pos[0]] = v[0]
            else:
                self.k[li][slots, :, pos] = k
                self.v[li][slots, :, pos] = v
            self._ffn(w, x, self._attend(q, li, slots, pos, slot))
        blas_threads(self.step_threads)
        return _rmsnorm(x, cfg.norm_eps)

    def _qkv(self, w, x, cos, sin):
        """A layer's rows x (N, C) -> q (N, H, D) and k (N, Hkv, D), rotated, and v (N, Hkv, D)."""
        cfg = self.cfg
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        N = x.shape[0]
        qkv = _mm(_rmsnorm(x, cfg.norm_eps), w["qkv_t"])  # (N, (H + 2 Hkv) D)
        qk = self._rope(qkv[:, : (H + Hkv) * D].reshape(N, H + Hkv, D), cos, sin)  # q and k rotated at once
        return qk[:, :H], qk[:, H:], qkv[:, (H + Hkv) * D :].reshape(N, Hkv, D)

    def _ffn(self, w, x, att):
        """The rest of a layer, in place on x: the attention output's projection, then the MLP."""
        x += _mm(att, w["o_t"])
        gu = _mm(_rmsnorm(x, self.cfg.norm_eps), w["gu_t"])
        F = self.cfg.hidden
        x += _mm(_silu_mul(gu[:, :F], gu[:, F:]), w["down_t"])

    # ---- long calls on one slot (a prefill): rows in shares, one worker a share -----------------------

    def _rows_long(self, ids, start: int, slot: int):
        """`_rows` of N rows at positions start..start+N-1 of one slot -> their states (N, C) before the
        final norm. The rows are dealt into one share per worker (up to `threads`), each fed through every
        layer by its own thread with one-thread BLAS, so that the matrix products and the element-wise NumPy
        work (which runs without the GIL) both use every core. Rows meet only in the cache: a worker waits
        for the others once a layer, after writing its keys and before attending to theirs. Each share is
        two blocks of positions, block i and block 2W-1-i of 2W, so every share has as many rows and as many
        keys to attend to (0 + 3 == 1 + 2)."""
        N = ids.shape[0]
        # workers only for enough work (a small model's prefill is a few milliseconds: waits would cost more)
        W = max(1, min(self.threads, N // WORKER_ROWS)) if N * self.cfg.dim**2 >= THREADED_MACS else 1
        edges = [N * i // (2 * W) for i in range(2 * W + 1)]
        shares = [[(edges[i], edges[i + 1]), (edges[2 * W - 1 - i], edges[2 * W - i])] for i in range(W)]
        barrier = threading.Barrier(W) if W > 1 else None
        before = blas_threads(1)
        try:
            if W == 1:
                parts = [self._feed_share(shares[0], ids, start, slot, None)]
            else:
                if self.pool is None:
                    self.pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="prefill")
                futures = [self.pool.submit(self._feed_share, sh, ids, start, slot, barrier) for sh in shares[1:]]
                try:
                    mine = self._feed_share(shares[0], ids, start, slot, barrier)
                except threading.BrokenBarrierError:
                    for f in futures:  # a worker failed and broke the barrier: its own error, not this one
                        f.result()
                    raise
                parts = [mine] + [f.result() for f in futures]
        finally:
            if before:
                blas_threads(before)
        x = np.empty((N, self.cfg.dim), dtype=self.dtype)
        for rows, xs in parts:
            x[rows] = xs
        return x

    def _feed_share(self, share, ids, start, slot, barrier):
        """One worker of `_rows_long`: its blocks [(a, b), ...] of rows through every layer -> (rows, states).
        A failure breaks the barrier, so that the other workers stop rather than wait for this one."""
        try:
            rows = np.concatenate([np.arange(a, b) for a, b in share])
            x = self.emb[ids[rows]]
            cos, sin = self.cos[start + rows][:, None, :], self.sin[start + rows][:, None, :]
            att = np.empty((rows.shape[0], self.cfg.n_heads * self.cfg.head_dim), dtype=self.dtype)
            for li, w in enumerate(self.layers):
                q, k, v = self._qkv(w, x, cos, sin)
                i = 0
                for a, b in share:
                    self.k[li][slot, :, start + a : start + b] = k[i : i + b - a].transpose(1, 0, 2)
                    self.v[li][slot, :, start + a : start + b] = v[i : i + b - a].transpose(1, 0, 2)
                    i += b - a
                if barrier is not None:
                    barrier.wait()  # every worker's keys and values of this layer are in the cache
                i = 0
                for a, b in share:
                    att[i : i + b - a] = self._attend_causal(q[i : i + b - a], li, slot, start + a)
                    i += b - a
                self._ffn(w, x, att)
            return rows, x
        except BaseException:
            if barrier is not None:
                barrier.abort()
            raise

    def _attend_causal(self, q, li, slot, p0):
        """q (n, H, D) of rows at positions p0..p0+n-1 of one slot -> (n, H*D), each over keys 0..its
        position, ATT_ROWS query rows at a time: a chunk's scores reach only its last row's position (half of
        the full square's work over a prefill) and fit in a core's cache. The softmax's division is applied to
        the (rows, D) output instead of the (rows, keys) probabilities."""
        n = q.shape[0]
        Hkv, G, D = self.cfg.n_kv_heads, self.cfg.group, self.cfg.head_dim
        out = np.empty((n, Hkv, G, D), dtype=q.dtype)
        for c in range(0, n, ATT_ROWS):
            m = min(ATT_ROWS, n - c)
            S = p0 + c + m  # keys 0..S-1; the chunk's rows sit at S-m..S-1
            k, v = self.k[li][slot, :, :S], self.v[li][slot, :, :S]  # (Hkv, S, D) views
            qh = q[c : c + m].reshape(m, Hkv, G, D).transpose(1, 0, 2, 3).reshape(Hkv, m * G, D)
            s = (qh @ k.transpose(0, 2, 1)).reshape(Hkv, m, G, S)
            s[..., S - m :] += self.later[:m, None, :m]
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s = s.reshape(Hkv, m * G, S)
            o = s @ v  # (Hkv, m*G, D)
            o /= (s @ self.ones[:S])[..., None]  # row sums as a product: BLAS's, ~3x NumPy's sum here
            out[c : c + m] = o.reshape(Hkv, m, G, D).transpose(1, 0, 2, 3)
        return out.reshape(n, Hkv * G * D)

    def _heads(self, xn, n_heads):
        """(N, C) -> (n_heads, N, V) logits of the first n_heads heads."""
        V = self.cfg.vocab_size
        w = self.head0_t if n_heads == 1 else self.heads_t[:, : n_heads * V]
        return _mm(xn, w).reshape(-1, n_heads, V).transpose(1, 0, 2)

    # ---- the backend interface ---------------------------------------------------------------------

    @_step_blas
    def prefill(self, slot: int, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        T = ids.shape[0]
        pos = np.arange(T)
        # causal attention over the prompt: row t sees keys 0..t, all written before attention reads them
        xn = self._rows(ids, np.full(T, slot), pos, slot)
        return self._heads(xn[-1:], self.cfg.mtp_heads)[:, 0]  # (K, V)

    @_step_blas
    def prefill_many(self, slots, prompts, starts=None) -> np.ndarray:
        """`prefill` of several slots in one pass over all their rows: (len(slots), K, V). `starts`: the
        positions each slot's cache already holds (`write_rows`); only the rows after them are fed."""
        starts = list(starts) if starts is not None else [0] * len(prompts)
        lens = [len(p) - s for p, s in zip(prompts, starts)]
        ids = np.concatenate([np.asarray(p[s:], dtype=np.int64) for p, s in zip(prompts, starts)])
        pos = np.concatenate([np.arange(s, len(p)) for p, s in zip(prompts, starts)])
        xn = self._rows(ids, np.repeat(np.asarray(slots), lens), pos, slots[0] if len(slots) == 1 else None)
        return self._heads(xn[np.cumsum(lens) - 1], self.cfg.mtp_heads).transpose(1, 0, 2)

    def decode(self, tokens, pos, sampling, step, rngs, mask) -> np.ndarray:
        if np.count_nonzero(mask) == 1:
            return self._tuned(self._decode, tokens, pos, sampling, step, rngs, mask)
        return self._decode(tokens, pos, sampling, step, rngs, mask)

    @_step_blas
    def _decode(self, tokens, pos, sampling, step, rngs, mask) -> np.ndarray:
        rows = np.flatnonzero(mask)
        out = np.asarray(tokens).copy()
        xn = self._rows(np.asarray(tokens)[rows], rows, np.asarray(pos)[rows], int(rows[0]) if len(rows) == 1 else None)
        logits = self._heads(xn, 1)[0]  # (n, V)
        for i, b in enumerate(rows):
            out[b] = sample_token(logits[i], rngs[b], sampling.temperature, sampling.top_k, sampling.top_p)
        return out

    def greedy_step(self, token: int, pos: int) -> tuple[int, np.ndarray]:
        """Feed one token of slot 0 at pos: (head 0's argmax, the row's final state (C,)). A plain greedy
        step whose state `draft_ids` can later turn into the drafts the other heads would have proposed."""
        return self._tuned(self._greedy_step, token, pos)

    @_step_blas
    def _greedy_step(self, token: int, pos: int) -> tuple[int, np.ndarray]:
        xn = self._rows(np.array([token]), np.zeros(1, dtype=np.int64), np.array([pos]), 0)
        return int(self._heads(xn, 1)[0, 0].argmax()), xn[0]

    @_step_blas
    def draft_ids(self, states) -> np.ndarray:
        """The draft heads' (1..K-1) argmax at final states (n, C): (K - 1, n) ids, one matrix product for
        all n rows (their weights read once, not once a step)."""
        V, K = self.cfg.vocab_size, self.cfg.mtp_heads
        states = np.asarray(states)
        return _mm(states, self.heads_t[:, V:]).reshape(-1, K - 1, V).argmax(axis=-1).T

    @_step_blas
    def verify(self, tokens, pos: int) -> np.ndarray:
        t = len(tokens)
        xn = self._rows(np.asarray(tokens, dtype=np.int64), np.zeros(t, dtype=np.int64), pos + np.arange(t), 0)
        return self._heads(xn, self.cfg.mtp_heads)  # (K, t, V)

    def _tuned(self, fn, *args):
        """fn(*args), a one-row step, on the thread count `self.tuner` picks, and its time recorded."""
        self.step_threads = self.tuner.pick()
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.tuner.record(time.perf_counter() - t0)
            self.step_threads = 1

    def verify_argmax(self, tokens, pos: int) -> np.ndarray:
        return self.verify(tokens, pos).argmax(axis=-1)  # (K, t)

    @_step_blas
    def verify_argmax_many(self, slots, blocks, pos) -> np.ndarray:
        """`verify_argmax` of several slots in one pass (the server's batched speculation): blocks (n, t), row i
        fed to slots[i] at pos[i]..pos[i]+t-1 -> (n, K, t) argmax ids."""
        blocks = np.asarray(blocks, dtype=np.int64)
        n, t = blocks.shape
        at = (np.asarray(pos, dtype=np.int64)[:, None] + np.arange(t)).reshape(-1)
        xn = self._rows(blocks.reshape(-1), np.repeat(np.asarray(slots), t), at, int(slots[0]) if n == 1 else None)
        return self._heads(xn, self.cfg.mtp_heads).argmax(axis=-1).reshape(-1, n, t).transpose(1, 0, 2)

    # ---- optional calls of the server: logits for log-probabilities and grammars, cached prefixes --------

    def decode_logits(self, tokens, pos, mask) -> np.ndarray:
        """`decode`'s forward without the choice: head-0 logits of the rows in `mask`, (n, V)."""
        rows = np.flatnonzero(mask)
        xn = self._rows(np.asarray(tokens)[rows], rows, np.asarray(pos)[rows])
        return self._heads(xn, 1)[0]

    def prefill_from(self, slot: int, ids, start: int) -> np.ndarray:
        """`prefill` of a slot whose cache already holds ids[:start]: only ids[start:] are fed. (K, V)."""
        return self.prefill_many([slot], [ids], [start])[0]

    def read_rows(self, slot: int, n: int) -> list:
        """A copy of the first `n` positions of a slot's cache (every layer's keys and values)."""
        return [(k[slot, :, :n].copy(), v[slot, :, :n].copy()) for k, v in zip(self.k, self.v)]

    def write_rows(self, slot: int, rows: list, n: int) -> None:
        """Put the first `n` positions of `read_rows`' copy into a slot's cache."""
        for (k, v), (rk, rv) in zip(zip(self.k, self.v), rows):
            k[slot, :, :n] = rk[:, :n]
            v[slot, :, :n] = rv[:, :n]
