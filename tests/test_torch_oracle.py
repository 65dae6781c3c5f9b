"""PyTorch autograd as an oracle: the same weights and batch through a PyTorch model written here from the
architecture of `nanoeuler.model.transformer`; the loss and every gradient must match ours in float64 to
1e-10 relative."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from nanoeuler.checks import problem  # noqa: E402
from nanoeuler.model import transformer  # noqa: E402
from nanoeuler.model.config import ModelConfig  # noqa: E402


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def torch_loss(P, ids, targets, cfg, head_weights=None):
    """The reference: an independent PyTorch rendering of the architecture (repeat_interleave for GQA,
    rotate_half RoPE, F.scaled_dot_product-free explicit softmax, F.cross_entropy with ignore_index);
    with head weights, the heads' weighted mean (over the heads with a target)."""
    B, T = ids.shape
    xn = torch_final_state(P, ids, cfg)
    heads = ["lm_head.weight"] + [f"mtp_heads.{k}.weight" for k in range(1, cfg.mtp_heads)]
    weights = [1.0] * cfg.mtp_heads if head_weights is None else head_weights
    losses, kept = [], []
    for k, name in enumerate(heads):
        tk = targets[:, :, k].reshape(-1)
        if (tk >= 0).any():
            losses.append(F.cross_entropy((xn @ P[name].T).reshape(B * T, -1), tk, ignore_index=-1))
            kept.append(weights[k])
    w = torch.tensor(kept, dtype=losses[0].dtype)
    return (torch.stack(losses) * w).sum() / w.sum()


def torch_final_state(P, ids, cfg):
    """The final normed state (B,T,C) of the PyTorch rendering."""
    B, T = ids.shape
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    dtype = P["embed_tokens.weight"].dtype
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    x = P["embed_tokens.weight"][ids]
    for i in range(cfg.n_layers):
        L = lambda n: P[f"layers.{i}.{n}.weight"]  # noqa: E731
        h = _rms(x, L("input_layernorm"), cfg.norm_eps)
        q = (h @ L("self_attn.q_proj").T).view(B, T, H, D).transpose(1, 2)
        k = (h @ L("self_attn.k_proj").T).view(B, T, Hkv, D).transpose(1, 2)
        v = (h @ L("self_attn.v_proj").T).view(B, T, Hkv, D).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
        a = (att @ v).transpose(1, 2).reshape(B, T, H * D)
        x = x + a @ L("self_attn.o_proj").T
        h = _rms(x, L("post_attention_layernorm"), cfg.norm_eps)
        x = x + (F.silu(h @ L("mlp.gate_proj").T) * (h @ L("mlp.up_proj").T)) @ L("mlp.down_proj").T
    return _rms(x, P["norm.weight"], cfg.norm_eps)


def _compare(cfg, params, inputs, targets, head_weights=None):
    P = {n: torch.tensor(p, dtype=torch.float64, requires_grad=True) for n, p in params.items()}
    ref = torch_loss(P, torch.tensor(inputs), torch.tensor(targets), cfg, head_weights)
    ref.backward()
    loss, grads = transformer.loss_and_grads(params, inputs, targets, cfg, head_weights=head_weights)
    assert abs(loss - ref.item()) <= 1e-10 * abs(ref.item())
    for name in params:
        want = P[name].grad.numpy() if P[name].grad is not None else np.zeros_like(params[name])
        err = np.linalg.norm(grads[name] - want) / max(np.linalg.norm(want), 1e-300)
        assert err <= 1e-10, f"{name}: relative error {err:.2e}"
        assert grads[name].dtype == np.float64


def test_gradcheck_config_matches_torch():
    cfg = problem.CHECK_CONFIG
    params, inputs, targets = problem.random_problem(cfg, seed=3, batch=3, T=7)
    _compare(cfg, params, inputs, targets)


def test_wider_groups_and_an_empty_head_match_torch():
    # group 3, K = 4 with head 3 having no valid target (left out of the mean), default ffn width
    cfg = ModelConfig(
        vocab_size=37,
        dim=24,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        ctx_len=16,
        mtp_heads=4,
        rope_theta=500.0,
        norm_eps=1e-6,
    )
    params, inputs, targets = problem.random_problem(cfg, seed=5, batch=2, T=9)
    targets[..., 3] = -1
    _compare(cfg, params, inputs, targets)
    _, grads = transformer.loss_and_grads(params, inputs, targets, cfg)
    assert not grads["mtp_heads.3.weight"].any()


@pytest.mark.parametrize("head_weights", [[1.0, 0.5, 0.25, 0.125], [1.0, 0.0, 0.4, 2.0]])
def test_head_weights_match_torch(head_weights):
    """The MTP heads' weighted loss (a schedule's start; a head of weight 0, whose gradient torch leaves
    zero); head 3 has no target, so its weight is left out of the mean."""
    cfg = ModelConfig(vocab_size=37, dim=24, n_layers=2, n_heads=6, n_kv_heads=2, ctx_len=16, mtp_heads=4)
    params, inputs, targets = problem.random_problem(cfg, seed=7, batch=2, T=9)
    targets[..., 3] = -1
    _compare(cfg, params, inputs, targets, head_weights)


def test_default_init_matches_torch():
    # the real init (small weights) and real window targets from one token stream
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ctx_len=16, mtp_heads=2)
    params = transformer.init_params(cfg, seed=0, dtype=np.float64)
    w = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 16 + cfg.mtp_heads))
    inputs = w[:, :16]
    targets = np.stack([w[:, 1 + k : 17 + k] for k in range(cfg.mtp_heads)], axis=-1)
    _compare(cfg, params, inputs, targets)
