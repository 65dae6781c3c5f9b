"""The NanoEuler transformer: forward, hand-written backward, multi-token loss, KV-cache decoding.

An embedding, `n_layers` pre-norm blocks, a final RMSNorm and K untied heads (head k predicts t+1+k):

    x = x + o_proj(attention(rope(q_proj(h)), rope(k_proj(h)), v_proj(h))),  h = rmsnorm(x)
    x = x + down_proj(silu(gate_proj(h)) * up_proj(h)),                       h = rmsnorm(x)

The loss averages, over the heads with a valid target (-1 is ignored), each head's mean cross-entropy; a
head without one is left out and gets a zero gradient. With head weights w the average is weighted:
sum_k w_k CE_k / sum_k w_k over those heads (`head_loss_scales`), so a head of weight 0 is not trained.
Parameters are a dict named as in HF Llama; the array module and dtype come from them, and every layer
is reached through `dispatch.ops_for(xp)`, so the GPU runs its kernels without a change here.
`init_params(cfg, seed)`: matrices ~ normal(0, 0.02), `o_proj`/`down_proj` ~ normal(0, 0.02 /
sqrt(2 n_layers)) so the stream's variance does not grow with depth, gains ones; drawn in float64 in
canonical order and rounded, so float64 and float32 inits agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nanoeuler.backend import array_module
from nanoeuler.model.config import ModelConfig
from nanoeuler.model.dispatch import ops_for

INIT_STD = 0.02


def init_params(cfg: ModelConfig, seed: int, dtype=np.float32, zero_out: bool = False) -> dict[str, np.ndarray]:
    """Gains of one; other matrices normal with INIT_STD, the output projections (o, down) scaled down by
    sqrt(2 n_layers) so the residual stream's variance stays put, or with `zero_out` zero: every block
    then starts as the identity and learns its branch (the same draws are made either way)."""
    rng = np.random.default_rng(seed)
    resid_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
    params = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith("norm.weight"):
            params[name] = np.ones(shape, dtype=dtype)
            continue
        out_proj = name.endswith(("o_proj.weight", "down_proj.weight"))
        std = resid_std if out_proj else INIT_STD
        params[name] = (rng.standard_normal(shape) * std).astype(dtype)
        if out_proj and zero_out:
            params[name][...] = 0
    return params


def head_weight_names(cfg: ModelConfig) -> list[str]:
    """The output head matrices, head 0 first."""
    return ["lm_head.weight"] + [f"mtp_heads.{k}.weight" for k in range(1, cfg.mtp_heads)]


def _ids(tokens, xp, V, what):
    ids = xp.asarray(tokens)
    if ids.ndim != 2:
        raise ValueError(f"{what} must be (B,T), got shape {ids.shape}")
    if xp is np and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"{what} hold ids outside [0, {V}): min {int(ids.min())}, max {int(ids.max())}")
    return ids


# ---- one block ---------------------------------------------------------------------------------


def _block_forward(ops, p, x, cos, sin, cfg, kv=None):
    """x (B,T,C) -> (B,T,C) and the cache. With `kv` = (k_buf, v_buf, start), the new keys/values are
    written into the KV-cache buffers (B,Hkv,max_len,D) at `start` and attention sees all keys so far.

    q/k/v and gate/up are each computed by one GEMM against the stacked weights: the same arithmetic
    as separate projections, with fewer and larger matrix products."""
    xp = array_module(x)
    B, T, C = x.shape
    H, Hkv, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
    HD, KD = H * D, Hkv * D
    h, n1 = ops.rmsnorm_forward(x, p["input_layernorm.weight"], cfg.norm_eps)  # (B,T,C)
    w_qkv = xp.concatenate(
        [p["self_attn.q_proj.weight"], p["self_attn.k_proj.weight"], p["self_attn.v_proj.weight"]]
    )  # (HD+2KD, C)
    qkv = ops.linear_forward(h, w_qkv)  # (B,T,HD+2KD)
    q = qkv[..., :HD].reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B,H,T,D) views
    k = qkv[..., HD : HD + KD].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # (B,Hkv,T,D)
    v = qkv[..., HD + KD :].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # (B,Hkv,T,D)
    q = ops.rope_forward(q, cos, sin)
    k = ops.rope_forward(k, cos, sin)
    if kv is not None:
        k_buf, v_buf, start = kv
        k_buf[:, :, start : start + T] = k
        v_buf[:, :, start : start + T] = v
        k, v = k_buf[:, :, : start + T], v_buf[:, :, : start + T]  # (B,Hkv,S,D)
    a, ac = ops.attention_forward(q, k, v)  # (B,H,T,D)
    a2 = a.transpose(0, 2, 1, 3).reshape(B, T, HD)  # (B,T,C)
    x = x + ops.linear_forward(a2, p["self_attn.o_proj.weight"])
    h2, n2 = ops.rmsnorm_forward(x, p["post_attention_layernorm.weight"], cfg.norm_eps)  # (B,T,C)
    w_gu = xp.concatenate([p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]])  # (2F, C)
    gu = ops.linear_forward(h2, w_gu)  # (B,T,2F)
    m, sc = ops.swiglu_forward(gu[..., :F], gu[..., F:])  # (B,T,F)
    x = x + ops.linear_forward(m, p["mlp.down_proj.weight"])
    return x, (h, n1, w_qkv, ac, a2, h2, n2, w_gu, m, sc)


def _block_backward(ops, p, dx, cache, cos, sin, cfg, grads, prefix):
    """dx (B,T,C): gradient of the block output -> gradient of its input; weight grads go into `grads`
    (the q/k/v and gate/up gradients are row blocks of one array each)."""
    xp = array_module(dx)
    h, n1, w_qkv, ac, a2, h2, n2, w_gu, m, sc = cache
    B, T, C = dx.shape
    H, Hkv, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
    HD, KD = H * D, Hkv * D
    # MLP branch: x_out = x_mid + down(swiglu(gate(h2), up(h2)))
    dm, grads[prefix + "mlp.down_proj.weight"] = ops.linear_backward(dx, m, p["mlp.down_proj.weight"])
    dg, du = ops.swiglu_backward(dm, sc)  # (B,T,F) each
    dgu = xp.empty((B, T, 2 * F), dtype=dx.dtype)
    dgu[..., :F] = dg
    dgu[..., F:] = du
    del dg, du
    dh2, dw_gu = ops.linear_backward(dgu, h2, w_gu)
    grads[prefix + "mlp.gate_proj.weight"] = dw_gu[:F]
    grads[prefix + "mlp.up_proj.weight"] = dw_gu[F:]
    dxn, grads[prefix + "post_attention_layernorm.weight"] = ops.rmsnorm_backward(dh2, n2)
    dx = dx + dxn  # gradient at x_mid
    # attention branch: x_mid = x_in + o(attn(rope(q(h)), rope(k(h)), v(h)))
    da2, grads[prefix + "self_attn.o_proj.weight"] = ops.linear_backward(dx, a2, p["self_attn.o_proj.weight"])
    da = da2.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B,H,T,D)
    dq, dk, dv = ops.attention_backward(da, ac)  # (B,H,T,D), (B,Hkv,T,D), (B,Hkv,T,D)
    dqkv = xp.empty((B, T, HD + 2 * KD), dtype=dx.dtype)  # (B,T,HD+2KD)
    dqkv[..., :HD].reshape(B, T, H, D)[...] = ops.rope_backward(dq, cos, sin).transpose(0, 2, 1, 3)
    dqkv[..., HD : HD + KD].reshape(B, T, Hkv, D)[...] = ops.rope_backward(dk, cos, sin).transpose(0, 2, 1, 3)
    dqkv[..., HD + KD :].reshape(B, T, Hkv, D)[...] = dv.transpose(0, 2, 1, 3)
    del dq, dk, dv
    dh, dw_qkv = ops.linear_backward(dqkv, h, w_qkv)
    grads[prefix + "self_attn.q_proj.weight"] = dw_qkv[:HD]
    grads[prefix + "self_attn.k_proj.weight"] = dw_qkv[HD : HD + KD]
    grads[prefix + "self_attn.v_proj.weight"] = dw_qkv[HD + KD :]
    dxn, grads[prefix + "input_layernorm.weight"] = ops.rmsnorm_backward(dh, n1)
    dx += dxn
    return dx


def _layer_params(params, i):
    prefix = f"layers.{i}."
    n = len(prefix)
    return {name[n:]: w for name, w in params.items() if name.startswith(prefix)}


# ---- the trunk: embedding, blocks, final norm --------------------------------------------------


def _trunk_forward(params, ids, cfg, ops, xp, keep: str = "all"):
    """ids (B,T) -> final normed state (B,T,C) and what the backward needs. `keep`: "all" keeps every
    block's cache; "inputs" only each block's input (gradient checkpointing: the backward recomputes the
    block's forward, trading a third more compute for one (B,T,C) array a layer); "none" nothing (a
    forward without a backward holds one block's activations at a time)."""
    T = ids.shape[1]
    emb = params["embed_tokens.weight"]
    cos, sin = ops.rope_tables(T, cfg.head_dim, cfg.rope_theta, xp, emb.dtype)
    x = ops.embedding_forward(ids, emb)  # (B,T,C)
    blocks = []
    for i in range(cfg.n_layers):
        x_in = x
        x, c = _block_forward(ops, _layer_params(params, i), x, cos, sin, cfg)
        blocks.append({"all": c, "inputs": x_in}.get(keep))
        del c, x_in
    xn, nc = ops.rmsnorm_forward(x, params["norm.weight"], cfg.norm_eps)  # (B,T,C)
    return xn, (cos, sin, blocks, nc if keep != "none" else None, keep)


def _trunk_backward(params, ids, dxn, cache, cfg, ops, grads):
    cos, sin, blocks, nc, keep = cache
    dx, grads["norm.weight"] = ops.rmsnorm_backward(dxn, nc)
    for i in reversed(range(cfg.n_layers)):
        p = _layer_params(params, i)
        block = blocks[i] if keep == "all" else _block_forward(ops, p, blocks[i], cos, sin, cfg)[1]
        blocks[i] = None  # free the layer's activations (or input) early
        dx = _block_backward(ops, p, dx, block, cos, sin, cfg, grads, f"layers.{i}.")
        del block
    grads["embed_tokens.weight"] = ops.embedding_backward(dx, ids, cfg.vocab_size)


def _check_targets(targets, ids, cfg, xp):
    targets = xp.asarray(targets)
    want = (*ids.shape, cfg.mtp_heads)
    if targets.shape != want:
        raise ValueError(f"targets must be (B,T,K) = {want}, got {targets.shape}")
    return targets


def _batch_on_device(params, inputs, targets, cfg):
    """The params' array module, its layer namespace, and the checked (B,T) ids and (B,T,K) targets on it."""
    xp = array_module(params["embed_tokens.weight"])
    ids = _ids(inputs, xp, cfg.vocab_size, "inputs")
    return xp, ops_for(xp), ids, _check_targets(targets, ids, cfg, xp)


# ---- public API --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Totals:
    """A whole step's valid targets per head and its rows, for a step cut into micro-batches: each
    micro-batch's loss is normalised by these, so the micro-batches' losses and gradients add up to
    those of the uncut batch (masked SFT batches hold different numbers of targets per micro-batch).

        >>> import numpy as np
        >>> step_totals([np.array([[[1, -1]]]), np.array([[[2, 3]], [[-1, -1]]])])
        Totals(counts=(2, 1), rows=3)
    """

    counts: tuple
    rows: int


def step_totals(targets_list) -> Totals:
    """The Totals of micro-batches' targets (B,T,K) (NumPy, on the host: no device sync)."""
    counts = sum(np.asarray((np.asarray(y) >= 0).reshape(-1, y.shape[-1]).sum(axis=0)) for y in targets_list)
    return Totals(tuple(int(c) for c in counts), sum(int(y.shape[0]) for y in targets_list))


def head_loss_scales(counts, head_weights=None) -> list[float]:
    """d(loss)/d(head k's summed cross-entropy) for heads of `counts` valid targets: w_k / (n_k * W), W the
    sum of the weights of the heads with a target (0 for a head without one; all 0 if W is). No weights:
    all 1, so the loss is the plain mean of the heads' mean cross-entropies.

        >>> head_loss_scales([4, 2, 0]), head_loss_scales([4, 2, 0], [1.0, 0.5, 0.25])
        ([0.125, 0.25, 0.0], [0.16666666666666666, 0.16666666666666666, 0.0])
    """
    weights = [1.0] * len(counts) if head_weights is None else [float(w) for w in head_weights]
    if len(weights) != len(counts):
        raise ValueError(f"{len(weights)} head weights for {len(counts)} output heads")
    total = sum(w for w, c in zip(weights, counts) if c > 0)
    return [w / (c * total) if c > 0 and w > 0 else 0.0 for w, c in zip(weights, counts)]


def mtp_cross_entropy(xn, params, targets, cfg: ModelConfig, totals: Totals | None = None, head_weights=None):
    """The pretraining loss on the final normed state: mean over the heads with a valid target of each
    head's mean cross-entropy, weighted by `head_weights` (K values >= 0; None: all 1). xn (B,T,C),
    targets (B,T,K) -> (loss, dxn (B,T,C), {head weight: grad}). With `totals` (of the whole step) the
    means divide by its counts: this micro-batch's share.

    A head of weight 0 is skipped (zero gradient) but stays in the model: speculative decoding drafts
    with the MTP heads (`infer/engine.py`), so a schedule that fades them out of the loss keeps them.

    This is the default `head_loss` of `loss_and_grads`; a stage with another objective (DPO) passes its
    own function of the same signature.
    """
    xp = array_module(xn)
    ops = ops_for(xp)
    B, T, C = xn.shape
    N = B * T
    xn2 = xn.reshape(N, C)  # (N,C)
    counts = [int(c) for c in (targets >= 0).reshape(N, cfg.mtp_heads).sum(axis=0)]
    scales = head_loss_scales(counts if totals is None else list(totals.counts), head_weights)
    grads: dict = {}
    dxn2 = xp.zeros_like(xn2)
    loss = 0.0
    for k, name in enumerate(head_weight_names(cfg)):
        if counts[k] == 0 or scales[k] == 0:
            grads[name] = xp.zeros_like(params[name])
            continue
        dloss_sum = scales[k]  # d(loss)/d(this head's summed cross-entropy)
        loss_sum, _, dx_k, grads[name] = ops.linear_cross_entropy(
            xn2, params[name], targets[:, :, k].reshape(N), dloss_sum
        )  # logits (N,V) live only inside
        loss += float(loss_sum) * dloss_sum
        dxn2 += dx_k
        del dx_k
    return loss, dxn2.reshape(B, T, C), grads


def loss_and_grads(
    params,
    inputs,
    targets,
    cfg: ModelConfig,
    head_loss=mtp_cross_entropy,
    totals: Totals | None = None,
    checkpoint: bool = False,
    head_weights=None,
):
    """inputs (B,T) int, targets (B,T,K) int (-1 ignored) -> (loss: float, grads: dict like params).

    `head_loss(xn, params, targets, cfg) -> (loss, dxn, head_grads)` turns the final normed state
    (B,T,C) into the loss; heads it leaves out of `head_grads` get zero gradients. `totals`: this is one
    micro-batch of a step of these totals, handed on to `head_loss` as `totals=`; `head_weights` (the
    output heads' loss weights this step) likewise. `checkpoint`: keep only each block's input and
    recompute its forward in the backward (the same loss and gradients).
    """
    xp, ops, ids, targets = _batch_on_device(params, inputs, targets, cfg)
    xn, trunk = _trunk_forward(params, ids, cfg, ops, xp, keep="inputs" if checkpoint else "all")
    share = {} if totals is None else {"totals": totals}  # a head loss without micro-batches needs no totals
    if head_weights is not None:  # nor one of a single head (DPO's) any weights
        share["head_weights"] = head_weights
    loss, dxn, grads = head_loss(xn, params, targets, cfg, **share)
    del xn
    for name in head_weight_names(cfg):
        if name not in grads:
            grads[name] = xp.zeros_like(params[name])
    _trunk_backward(params, ids, dxn, trunk, cfg, ops, grads)
    return loss, {name: grads[name] for name in params}


def forward_loss(params, inputs, targets, cfg: ModelConfig, head_weights=None):
    """The loss without a backward (evaluation) -> (loss: float, head_losses: list[float], head 0 first).
    `head_weights`: the loss as `mtp_cross_entropy` weights it (None: the plain mean over the heads)."""
    xp, ops, ids, targets = _batch_on_device(params, inputs, targets, cfg)
    N = ids.size
    xn, _ = _trunk_forward(params, ids, cfg, ops, xp, keep="none")
    xn2 = xn.reshape(N, cfg.dim)
    head_losses, sums, counts = [], [], []
    for k, name in enumerate(head_weight_names(cfg)):
        loss_sum, n_valid, _, _ = ops.linear_cross_entropy(xn2, params[name], targets[:, :, k].reshape(N))
        head_losses.append(float(loss_sum) / n_valid if n_valid else 0.0)
        sums.append(float(loss_sum))
        counts.append(int(n_valid))
    if head_weights is None:
        active = [h for h, c in zip(head_losses, counts) if c]
        return (sum(active) / len(active) if active else 0.0), head_losses
    loss = sum(s * scale for s, scale in zip(sums, head_loss_scales(counts, head_weights)))
    return loss, head_losses


def final_state(params, inputs, cfg: ModelConfig):
    """inputs (B,T) -> (B,T,C) the final norm's output, what every output head reads (no backward kept)."""
    emb = params["embed_tokens.weight"]
    xp = array_module(emb)
    ids = _ids(inputs, xp, cfg.vocab_size, "inputs")
    return _trunk_forward(params, ids, cfg, ops_for(xp), xp, keep="none")[0]


def logits(params, inputs, cfg: ModelConfig, head: int = 0):
    """inputs (B,T) -> (B,T,V) logits of output head `head` (0: next token)."""
    xn = final_state(params, inputs, cfg)
    return ops_for(array_module(xn)).linear_forward(xn, params[head_weight_names(cfg)[head]])


# ---- incremental decoding ----------------------------------------------------------------------


class KVCache:
    """Keys and values of the tokens decoded so far, per layer, in buffers (B,Hkv,max_len,D).

    `length` is the number of positions filled; the next token sits at position `length`.
    `rewind(n)` forgets everything after the first n positions (e.g. rejected speculative drafts).
    """

    def __init__(self, k: list, v: list, max_len: int):
        self.k = k
        self.v = v
        self.max_len = max_len
        self.length = 0

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a KV cache of length {self.length} to {length}")
        self.length = length


def new_kv_cache(cfg: ModelConfig, batch: int, max_len: int, xp=np, dtype=np.float32) -> KVCache:
    shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    k = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]
    v = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]
    return KVCache(k, v, max_len)


def forward_step(params, tokens, cache: KVCache, cfg: ModelConfig, all_heads: bool = False):
    """Feed tokens (B,t) at positions cache.length .. cache.length+t-1 -> (B,t,V) head-0 logits.

    Appends the tokens' keys and values to the cache. With all_heads=True returns (K,B,t,V), every head.
    """
    emb = params["embed_tokens.weight"]
    xp = array_module(emb)
    ops = ops_for(xp)
    ids = _ids(tokens, xp, cfg.vocab_size, "tokens")
    B, t = ids.shape
    start = cache.length
    if B != cache.batch:
        raise ValueError(f"tokens have batch {B} but the KV cache was made for {cache.batch}")
    if start + t > cache.max_len:
        raise ValueError(f"KV cache holds {cache.max_len} positions; {start} used, {t} more asked for")
    cos, sin = ops.rope_tables(t, cfg.head_dim, cfg.rope_theta, xp, emb.dtype, offset=start)
    x = ops.embedding_forward(ids, emb)  # (B,t,C)
    for i in range(cfg.n_layers):
        x, _ = _block_forward(ops, _layer_params(params, i), x, cos, sin, cfg, kv=(cache.k[i], cache.v[i], start))
    cache.length = start + t
    xn, _ = ops.rmsnorm_forward(x, params["norm.weight"], cfg.norm_eps)
    if all_heads:
        return xp.stack([ops.linear_forward(xn, params[n]) for n in head_weight_names(cfg)])
    return ops.linear_forward(xn, params["lm_head.weight"])
