"""The random problem every gradient check starts from: a small model and a batch that exercise each term.

`CHECK_CONFIG` has K = 3 heads, 2 query heads per key/value head and a context of 8, so RoPE, the causal
mask and grouped-query attention all matter; `random_problem` draws weights of order one and about a
fifth of the targets ignored, so a wrong term in any backward shows up. `gradcheck` (finite differences),
`gradcheck_gpu` (float32 kernels vs float64) and the bf16 engine's self-test use it.

    >>> params, inputs, targets = random_problem(CHECK_CONFIG, seed=0, batch=2, T=6)
    >>> inputs.shape, targets.shape, bool((targets[0, 0] == -1).all())
    ((2, 6), (2, 6, 3), True)
"""

from __future__ import annotations

import numpy as np

from nanoeuler.model.config import ModelConfig

CHECK_CONFIG = ModelConfig(
    vocab_size=13,
    dim=16,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ctx_len=8,
    ffn_hidden=24,
    mtp_heads=3,
    rope_theta=10000.0,
    norm_eps=1e-5,
)


def random_problem(cfg: ModelConfig = CHECK_CONFIG, seed: int = 0, batch: int = 2, T: int = 6):
    """(params float64, inputs (B,T), targets (B,T,K)) with weights of order one and ~20% ignored targets."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith("norm.weight"):
            params[name] = 1.0 + 0.3 * rng.standard_normal(shape)  # gains away from 1 so they matter
        elif name == "embed_tokens.weight":
            params[name] = rng.standard_normal(shape)
        else:  # (out, in): unit-variance outputs for unit-variance inputs
            params[name] = rng.standard_normal(shape) / np.sqrt(shape[1])
    window = rng.integers(0, cfg.vocab_size, size=(batch, T + cfg.mtp_heads))
    inputs = window[:, :T]
    targets = np.stack([window[:, 1 + k : T + 1 + k] for k in range(cfg.mtp_heads)], axis=-1)
    full = targets
    targets = np.where(rng.random(targets.shape) < 0.2, -1, targets)
    targets[0, 0, :] = -1  # a position with no target at all
    for k in range(cfg.mtp_heads):  # but every head keeps some
        if not (targets[..., k] >= 0).any():
            targets[-1, -1, k] = full[-1, -1, k]
    return params, inputs, targets
