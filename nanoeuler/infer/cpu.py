"""The decode engine's NumPy backend: the model's arithmetic on rows of (slot, position), with a
preallocated cache.

    >>> be = CpuBackend(params, cfg)          # params: NumPy float32 (or float64 for exact checks)   # doctest: +SKIP
    >>> be.start(batch=2, seeds=[0, 1]); be.prefill(0, [5, 17, 42]).shape                          # doctest: +SKIP
    (4, 512)

Same layers as `transformer.forward_step` (`model.layers` is the reference): the weights are stacked once at
load (q/k/v into one matrix, gate/up into one, the K output heads into one), the RoPE angles of every
position are tabulated once, and the cache (slots, Hkv, ctx_len, D) per layer is allocated once per
`start`; a decode step allocates only NumPy's temporaries. Rows of one call may sit at different
positions of different slots (ragged batches); each attends to its own slot's keys up to its position.
"""

from __future__ import annotations

import numpy as np

from nanoeuler.infer.generate import sample_token
from nanoeuler.model import layers
from nanoeuler.model.transformer import head_weight_names


FEW_ROWS = 32


def _mm(x, w):
    """x (N, in) @ w (in, out). A few rows go one at a time: OpenBLAS runs a one-row product on one thread,
    but hands a product of 2..32 rows to its thread pool, which costs far more than the arithmetic on a small
    model (BENCHMARKS.md, CPU decode)."""
    if 1 < x.shape[0] <= FEW_ROWS:
        return np.stack([row @ w for row in x])
    return x @ w


class CpuBackend:
    # a verify pass's time in decode steps (`small`, 2 threads: 3.0 tokens a pass ran 1.15x plain; BENCHMARKS.md)
    verify_cost = 2.6

    def __init__(self, params: dict, cfg):
        p = {k: np.asarray(v) for k, v in params.items()}
        self.cfg = cfg
        self.dtype = p["lm_head.weight"].dtype
        self.emb = p["embed_tokens.weight"]
        self.layers = []
        for i in range(cfg.n_layers):
            g = lambda n: p[f"layers.{i}.{n}"]  # noqa: E731
            self.layers.append(dict(
                n1=g("input_layernorm.weight"), n2=g("post_attention_layernorm.weight"),
                qkv_t=np.ascontiguousarray(np.concatenate(
                    [g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight")]).T),
                o_t=np.ascontiguousarray(g("self_attn.o_proj.weight").T),
                gu_t=np.ascontiguousarray(np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]).T),
                down_t=np.ascontiguousarray(g("mlp.down_proj.weight").T)))
        self.norm = p["norm.weight"]
        self.heads_t = np.ascontiguousarray(np.concatenate([p[n] for n in head_weight_names(cfg)]).T)  # (C, K*V)
        cos, sin = layers.rope_tables(cfg.ctx_len, cfg.head_dim, cfg.rope_theta, np, self.dtype)
        self.cos, self.sin = cos, sin  # (ctx_len, D/2)
        self.k = self.v = None

    def start(self, batch: int, seeds=None) -> None:
        cfg = self.cfg
        shape = (batch, cfg.n_kv_heads, cfg.ctx_len, cfg.head_dim)
        if self.k is None or self.k[0].shape != shape:
            self.k = [np.zeros(shape, dtype=self.dtype) for _ in range(cfg.n_layers)]
            self.v = [np.zeros(shape, dtype=self.dtype) for _ in range(cfg.n_layers)]

    # ---- the forward over rows ---------------------------------------------------------------------

    def _rope(self, x, cos, sin):
        """x (N, heads, D); cos/sin (N, 1, D/2)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _attend(self, q, li, slots, pos):
        """q (N,H,D) of rows at (slot, pos) -> (N, H*D), over keys 0..pos of each row's slot."""
        cfg = self.cfg
        N, H, D = q.shape
        Hkv, G = cfg.n_kv_heads, cfg.group
        S = int(pos.max()) + 1
        k = self.k[li][slots, :, :S]  # (N,Hkv,S,D)
        v = self.v[li][slots, :, :S]
        qg = (q * (1.0 / np.sqrt(D))).reshape(N, Hkv, G, D)
        # einsum's own loops, not BLAS: a stack of (G, D) @ (D, S) products is too small for a thread pool
        s = np.einsum("nhgd,nhsd->nhgs", qg, k)  # (N,Hkv,G,S)
        if S > 1:
            hidden = np.arange(S)[None, :] > pos[:, None]  # (N,S)
            s[np.broadcast_to(hidden[:, None, None, :], s.shape)] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        return np.einsum("nhgs,nhsd->nhgd", s, v).reshape(N, H * D)

    def _rows(self, ids, slots, pos):
        """Feed rows: ids, slots, pos (N,) -> final normed states (N, C). Writes each row's k/v at (slot, pos)."""
        cfg = self.cfg
        H, Hkv, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
        HD, KD = H * D, Hkv * D
        N = ids.shape[0]
        x = self.emb[ids]  # (N,C)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # (N,1,D/2)
        for li, w in enumerate(self.layers):
            h, _ = layers.rmsnorm_forward(x, w["n1"], cfg.norm_eps)
            qkv = _mm(h, w["qkv_t"])  # (N, HD+2KD)
            q = self._rope(qkv[:, :HD].reshape(N, H, D), cos, sin)
            self.k[li][slots, :, pos] = self._rope(qkv[:, HD:HD + KD].reshape(N, Hkv, D), cos, sin)
            self.v[li][slots, :, pos] = qkv[:, HD + KD:].reshape(N, Hkv, D)
            x = x + _mm(self._attend(q, li, slots, pos), w["o_t"])
            h2, _ = layers.rmsnorm_forward(x, w["n2"], cfg.norm_eps)
            gu = _mm(h2, w["gu_t"])
            m, _ = layers.swiglu_forward(gu[:, :F], gu[:, F:])
            x = x + _mm(m, w["down_t"])
        xn, _ = layers.rmsnorm_forward(x, self.norm, cfg.norm_eps)
        return xn

    def _heads(self, xn, n_heads):
        """(N, C) -> (n_heads, N, V) logits of the first n_heads heads."""
        V = self.cfg.vocab_size
        return _mm(xn, self.heads_t[:, :n_heads * V]).reshape(-1, n_heads, V).transpose(1, 0, 2)

    # ---- the backend interface ---------------------------------------------------------------------

    def prefill(self, slot: int, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        T = ids.shape[0]
        pos = np.arange(T)
        # causal attention over the prompt: row t sees keys 0..t, all written before attention reads them
        xn = self._rows(ids, np.full(T, slot), pos)
        return self._heads(xn[-1:], self.cfg.mtp_heads)[:, 0]  # (K, V)

    def prefill_many(self, slots, prompts) -> np.ndarray:
        """`prefill` of several slots in one pass over all their rows: (len(slots), K, V)."""
        lens = [len(p) for p in prompts]
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        pos = np.concatenate([np.arange(n) for n in lens])
        xn = self._rows(ids, np.repeat(np.asarray(slots), lens), pos)
        return self._heads(xn[np.cumsum(lens) - 1], self.cfg.mtp_heads).transpose(1, 0, 2)

    def decode(self, tokens, pos, sampling, step, rngs, mask) -> np.ndarray:
        rows = np.flatnonzero(mask)
        out = np.asarray(tokens).copy()
        xn = self._rows(np.asarray(tokens)[rows], rows, np.asarray(pos)[rows])
        logits = self._heads(xn, 1)[0]  # (n, V)
        for i, b in enumerate(rows):
            out[b] = sample_token(logits[i], rngs[b], sampling.temperature, sampling.top_k, sampling.top_p)
        return out

    def verify(self, tokens, pos: int) -> np.ndarray:
        t = len(tokens)
        xn = self._rows(np.asarray(tokens, dtype=np.int64), np.zeros(t, dtype=np.int64), pos + np.arange(t))
        return self._heads(xn, self.cfg.mtp_heads)  # (K, t, V)

    def verify_argmax(self, tokens, pos: int) -> np.ndarray:
        return self.verify(tokens, pos).argmax(axis=-1)  # (K, t)

    # ---- optional calls of the server: logits for log-probabilities and grammars, cached prefixes --------

    def decode_logits(self, tokens, pos, mask) -> np.ndarray:
        """`decode`'s forward without the choice: head-0 logits of the rows in `mask`, (n, V)."""
        rows = np.flatnonzero(mask)
        xn = self._rows(np.asarray(tokens)[rows], rows, np.asarray(pos)[rows])
        return self._heads(xn, 1)[0]

    def prefill_from(self, slot: int, ids, start: int) -> np.ndarray:
        """`prefill` of a slot whose cache already holds ids[:start]: only ids[start:] are fed. (K, V)."""
        ids = np.asarray(ids, dtype=np.int64)[start:]
        pos = start + np.arange(ids.shape[0])
        xn = self._rows(ids, np.full(ids.shape[0], slot), pos)
        return self._heads(xn[-1:], self.cfg.mtp_heads)[:, 0]

    def read_rows(self, slot: int, n: int) -> list:
        """A copy of the first `n` positions of a slot's cache (every layer's keys and values)."""
        return [(k[slot, :, :n].copy(), v[slot, :, :n].copy()) for k, v in zip(self.k, self.v)]

    def write_rows(self, slot: int, rows: list, n: int) -> None:
        """Put the first `n` positions of `read_rows`' copy into a slot's cache."""
        for (k, v), (rk, rv) in zip(zip(self.k, self.v), rows):
            k[slot, :, :n] = rk[:, :n]
            v[slot, :, :n] = rv[:, :n]
