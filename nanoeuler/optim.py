"""AdamW and Muon with decoupled weight decay, global-norm gradient clipping, the learning-rate
schedules (warmup, then cosine or warmup-stable-decay) and the output heads' loss-weight schedule.

Works on NumPy or CuPy arrays alike (the state lives where the parameters live) and updates in place.

    >>> opt = AdamW(params, weight_decay=0.1)                               # doctest: +SKIP
    >>> norm = clip_grad_norm(grads, 1.0)                                   # doctest: +SKIP
    >>> opt.step(params, grads, lr_at(step, max_lr=3e-4, min_lr=3e-5, warmup_steps=100,  # doctest: +SKIP
    ...                               total_steps=5000))
    >>> opt = Muon(params, lr_scale=muon_lr_scale(params, muon_lr=6e-3, lr=6e-4))   # doctest: +SKIP

Each parameter belongs to one group (`param_group`: embed, head, norm or hidden); a run gives each group
a peak learning rate as a multiple of the scheduled one (`lr_scale`), so one schedule drives them all.
"""

from __future__ import annotations

import math


from nanoeuler.backend import array_module
from nanoeuler.model.dispatch import fused_adamw


def default_no_decay(name: str, shape) -> bool:
    """Norm gains (1-D) and the token embedding are not decayed."""
    return len(shape) < 2 or name.endswith("norm.weight") or name.startswith("embed_tokens.")


HIDDEN_MATRICES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
GROUPS = ("embed", "head", "norm", "hidden")


def param_group(name: str) -> str:
    """The learning-rate group of a parameter.

    >>> [param_group(n) for n in ("embed_tokens.weight", "mtp_heads.2.weight", "norm.weight",
    ...                           "layers.3.mlp.down_proj.weight")]
    ['embed', 'head', 'norm', 'hidden']
    """
    if name.startswith("embed_tokens."):
        return "embed"
    if name.startswith(("lm_head.", "mtp_heads.")):
        return "head"
    if name.endswith("norm.weight"):
        return "norm"
    if name.startswith("layers.") and name.rsplit(".", 2)[-2] in {h.split(".")[1] for h in HIDDEN_MATRICES}:
        return "hidden"
    raise ValueError(f"parameter {name!r} is in no learning-rate group")


def group_lr_scale(names, scales: dict | None = None) -> dict:
    """{name: multiplier of the scheduled lr} from per-group multipliers (groups left out: 1)."""
    scales = scales or {}
    unknown = set(scales) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown learning-rate groups {sorted(unknown)} (groups: {GROUPS})")
    return {n: float(scales.get(param_group(n), 1.0)) for n in names}


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter):

        m = b1 m + (1-b1) g ;  v = b2 v + (1-b2) g^2
        p -= lr * wd * p                                    (tensors not in no_decay)
        p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)

    `no_decay`: names of tensors to exempt from weight decay; None exempts norms and the embedding.
    `lr_scale`: {name: multiplier} of `step`'s lr for that tensor (missing: 1). `names`: update only these
    (Muon hands AdamW the tensors it does not orthogonalise); None: all of `params`.
    """

    def __init__(
        self,
        params: dict,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        no_decay=None,
        lr_scale: dict | None = None,
        names=None,
    ):
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        if no_decay is None:
            self.no_decay = {n for n, p in params.items() if default_no_decay(n, p.shape)}
        else:
            self.no_decay = set(no_decay)
            unknown = self.no_decay - set(params)
            if unknown:
                raise ValueError(f"no_decay names unknown parameters: {sorted(unknown)}")
        self.lr_scale = dict(lr_scale or {})
        self.m = {}
        self.v = {}
        for n in params if names is None else names:
            xp = array_module(params[n])
            self.m[n] = xp.zeros_like(params[n])
            self.v[n] = xp.zeros_like(params[n])
        self.t = 0

    def step(self, params: dict, grads: dict, lr: float) -> None:
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        bc1 = 1.0 - b1**self.t
        bc2 = 1.0 - b2**self.t
        inv_sqrt_bc2 = 1.0 / math.sqrt(bc2)
        fused = fused_adamw(params)
        for n in self.m:
            p, g, m, v = params[n], grads[n], self.m[n], self.v[n]
            lr_n = lr * self.lr_scale.get(n, 1.0)
            step_size = lr_n / bc1
            decay = 1.0 - lr_n * self.weight_decay if self.weight_decay and n not in self.no_decay else 1.0
            if fused is not None:
                fused(
                    p,
                    g,
                    m,
                    v,
                    beta1=b1,
                    beta2=b2,
                    eps=self.eps,
                    decay=decay,
                    step_size=step_size,
                    inv_sqrt_bc2=inv_sqrt_bc2,
                )
                continue
            xp = array_module(p)
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * (g * g)
            if decay != 1.0:
                p *= decay
            denom = xp.sqrt(v)
            denom *= inv_sqrt_bc2
            denom += self.eps
            upd = m / denom
            upd *= step_size
            p -= upd

    def state_tensors(self) -> dict:
        """{"m.<name>": m, "v.<name>": v} for every parameter (arrays, not copies)."""
        out = {}
        for n in self.m:
            out[f"m.{n}"] = self.m[n]
            out[f"v.{n}"] = self.v[n]
        return out

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        """Restore the moments (moved onto each parameter's backend) and the step count."""
        for n in self.m:
            for key, store in (("m", self.m), ("v", self.v)):
                name = f"{key}.{n}"
                if name not in tensors:
                    raise ValueError(f"optimizer state lacks {name}")
                src = tensors[name]
                if tuple(src.shape) != tuple(store[n].shape):
                    raise ValueError(
                        f"optimizer state {name} has shape {tuple(src.shape)}, expected {tuple(store[n].shape)}"
                    )
                xp = array_module(store[n])
                store[n] = xp.asarray(src, dtype=store[n].dtype).copy()
        self.t = int(t)


# Newton-Schulz quintic X <- a X + b (X X^T) X + c (X X^T)^2 X: coefficients chosen (K. Jordan, "Muon",
# 2024) to push every singular value in (0, 1] quickly towards 1, trading exactness (they end in about
# [0.7, 1.2]) for speed; the singular vectors are kept, so the result approximates the polar factor U V^T.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def newton_schulz(g, steps: int = NS_STEPS, eps: float = 1e-7):
    """The approximately orthogonal matrix with g's singular vectors (U V^T for g = U S V^T), g (rows, cols)
    or a stack (..., rows, cols), in g's dtype. Scaled by its Frobenius norm first, so every singular value
    is at most 1. A tall matrix iterates on X^T X (cols x cols) rather than X X^T: the smaller product.

        >>> import numpy as np
        >>> o = newton_schulz(np.diag([1.0, 0.5, 0.1]))
        >>> bool(np.all((np.diag(o) > 0.6) & (np.diag(o) < 1.25)))
        True
    """
    xp = array_module(g)
    a, b, c = NS_COEFFS
    x = g / (xp.sqrt((g * g).sum(axis=(-2, -1), keepdims=True)) + eps)
    tall = g.shape[-2] > g.shape[-1]
    for _ in range(steps):
        if tall:  # X (a + b A + c A^2), A = X^T X: the same polynomial in the singular values
            A = xp.swapaxes(x, -1, -2) @ x
            x = a * x + x @ (b * A + c * (A @ A))
        else:
            A = x @ xp.swapaxes(x, -1, -2)
            x = a * x + (b * A + c * (A @ A)) @ x
    return x


def muon_scale(shape) -> float:
    """Muon's per-shape factor: orthogonal updates have entries of RMS 1/sqrt(max(rows, cols)); times
    0.2 sqrt(max(rows, cols)) their RMS is 0.2, about AdamW's, so both share weight decay and learning-rate
    units (Liu et al., "Muon is scalable for LLM training", 2025).

        >>> muon_scale((256, 768)), muon_scale((768, 2048)) > muon_scale((768, 768))
        (5.542562584220407, True)
    """
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class Muon:
    """Muon for the hidden matrices (q, k, v, o, gate, up, down of every layer), AdamW for the rest
    (the embedding, the output heads, the norm gains). For a hidden matrix W with gradient g:

        m = mu m + g ;  u = g + mu m                                  (Nesterov momentum)
        W -= lr * wd * W                                              (decoupled weight decay)
        W -= lr * muon_scale(W.shape) * newton_schulz(u)

    `lr_scale`: {name: multiplier of step's lr} for every tensor (Muon's own lr as a multiple of the
    schedule's, say); the other arguments are AdamW's. `orthogonalize(u, steps)`: newton_schulz, or a
    stand-in (the self-test's, which rounds where the bf16 engine rounds). State: the momentum
    "m.<name>" of each hidden matrix, AdamW's moments of the rest, one step count.
    """

    def __init__(
        self,
        params: dict,
        momentum: float = 0.95,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        no_decay=None,
        lr_scale: dict | None = None,
        ns_steps: int = NS_STEPS,
        orthogonalize=None,
    ):
        self.momentum, self.weight_decay, self.ns_steps = float(momentum), float(weight_decay), int(ns_steps)
        self.orthogonalize = orthogonalize or newton_schulz
        self.lr_scale = dict(lr_scale or {})
        self.hidden = [n for n in params if param_group(n) == "hidden"]
        self.adam = AdamW(
            params,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            no_decay=no_decay,
            lr_scale=lr_scale,
            names=[n for n in params if n not in self.hidden],
        )
        self.m = {n: array_module(params[n]).zeros_like(params[n]) for n in self.hidden}

    @property
    def t(self) -> int:
        return self.adam.t

    def step(self, params: dict, grads: dict, lr: float) -> None:
        self.adam.step(params, grads, lr)
        for n in self.hidden:
            p, g, m = params[n], grads[n], self.m[n]
            m *= self.momentum
            m += g
            u = g + self.momentum * m
            lr_n = lr * self.lr_scale.get(n, 1.0)
            if self.weight_decay:
                p *= 1.0 - lr_n * self.weight_decay
            p -= (lr_n * muon_scale(p.shape)) * self.orthogonalize(u, self.ns_steps).astype(p.dtype, copy=False)

    def state_tensors(self) -> dict:
        """{"m.<name>": momentum} of the hidden matrices and AdamW's {"m.", "v."} of the rest (arrays)."""
        return {**self.adam.state_tensors(), **{f"m.{n}": m for n, m in self.m.items()}}

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        self.adam.load_state_tensors(tensors, t)
        for n in self.m:
            src = tensors.get(f"m.{n}")
            if src is None or tuple(src.shape) != tuple(self.m[n].shape):
                raise ValueError(f"optimizer state lacks m.{n} of shape {tuple(self.m[n].shape)}")
            self.m[n] = array_module(self.m[n]).asarray(src, dtype=self.m[n].dtype).copy()


def clip_grad_norm(grads: dict, max_norm: float) -> float:
    """Scale all gradients in place so their global L2 norm is at most max_norm (<= 0: no clipping).

    Returns the norm before clipping (inf or nan pass through unscaled, for the caller to report)."""
    squares = [array_module(g).vdot(g.ravel(), g.ravel()) for g in grads.values()]  # stay on the device
    norm = math.sqrt(float(sum(squares))) if squares else 0.0
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads.values():
            g *= scale
    return norm


def lr_at(
    step: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "cosine",
    cooldown_frac: float = 0.2,
) -> float:
    """Learning rate at 0-based `step`: linear warmup over warmup_steps to max_lr (step 0 gets
    max_lr/warmup_steps), then down to min_lr at total_steps, and min_lr after. "cosine": a half cosine
    over all the steps after warmup; "wsd" (warmup-stable-decay): max_lr until the last `cooldown_frac`
    of total_steps, then a straight line to min_lr.

        >>> [round(lr_at(s, max_lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=10, schedule="wsd",
        ...              cooldown_frac=0.4), 2) for s in (0, 5, 6, 8, 10)]
        [1.0, 1.0, 1.0, 0.5, 0.0]
    """
    if warmup_steps > 0 and step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    if schedule == "wsd":
        cooldown = max(1, round(cooldown_frac * total_steps))
        left = total_steps - step
        return max_lr if left >= cooldown else min_lr + (max_lr - min_lr) * left / cooldown
    if schedule != "cosine":
        raise ValueError(f"schedule {schedule!r}: cosine or wsd")
    decay_steps = max(1, total_steps - warmup_steps)
    progress = (step - warmup_steps) / decay_steps
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def head_weights_at(step: int, total_steps: int, start, end=None) -> list[float]:
    """The output heads' loss weights at 0-based `step`: a straight line from `start` (step 0) to `end`
    (the last step, total_steps - 1; None: `start` throughout), weight by weight.

        >>> head_weights_at(5, 11, [1.0, 0.5, 0.25, 0.125], [1.0, 0.0, 0.0, 0.0])
        [1.0, 0.25, 0.125, 0.0625]
    """
    end = start if end is None else end
    if len(end) != len(start):
        raise ValueError(f"{len(start)} starting head weights but {len(end)} final ones")
    frac = min(1.0, max(0.0, step / max(1, total_steps - 1)))
    return [float(a) + (float(b) - float(a)) * frac for a, b in zip(start, end)]
