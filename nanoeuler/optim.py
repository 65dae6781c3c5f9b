"""AdamW with decoupled weight decay, global-norm gradient clipping, warmup + cosine learning rate.

Works on NumPy or CuPy arrays alike (the state lives where the parameters live) and updates in place.

    >>> opt = AdamW(params, weight_decay=0.1)                               # doctest: +SKIP
    >>> norm = clip_grad_norm(grads, 1.0)                                   # doctest: +SKIP
    >>> opt.step(params, grads, lr_at(step, max_lr=3e-4, min_lr=3e-5, warmup_steps=100, total_steps=5000))
"""

from __future__ import annotations

import math


from nanoeuler.backend import array_module
from nanoeuler.dispatch import fused_adamw


def default_no_decay(name: str, shape) -> bool:
    """Norm gains (1-D) and the token embedding are not decayed."""
    return len(shape) < 2 or name.endswith("norm.weight") or name.startswith("embed_tokens.")


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter):

        m = b1 m + (1-b1) g ;  v = b2 v + (1-b2) g^2
        p -= lr * wd * p                                    (tensors not in no_decay)
        p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)

    `no_decay`: names of tensors to exempt from weight decay; None exempts norms and the embedding.
    """

    def __init__(self, params: dict, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, no_decay=None):
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
        self.m = {}
        self.v = {}
        for n, p in params.items():
            xp = array_module(p)
            self.m[n] = xp.zeros_like(p)
            self.v[n] = xp.zeros_like(p)
        self.t = 0

    def step(self, params: dict, grads: dict, lr: float) -> None:
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        bc1 = 1.0 - b1 ** self.t
        bc2 = 1.0 - b2 ** self.t
        step_size = lr / bc1
        inv_sqrt_bc2 = 1.0 / math.sqrt(bc2)
        fused = fused_adamw(params)
        for n, p in params.items():
            g, m, v = grads[n], self.m[n], self.v[n]
            decay = 1.0 - lr * self.weight_decay if self.weight_decay and n not in self.no_decay else 1.0
            if fused is not None:
                fused(p, g, m, v, beta1=b1, beta2=b2, eps=self.eps, decay=decay,
                      step_size=step_size, inv_sqrt_bc2=inv_sqrt_bc2)
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
                    raise ValueError(f"optimizer state {name} has shape {tuple(src.shape)}, "
                                     f"expected {tuple(store[n].shape)}")
                xp = array_module(store[n])
                store[n] = xp.asarray(src, dtype=store[n].dtype).copy()
        self.t = int(t)


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


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate at 0-based `step`: linear warmup over warmup_steps to max_lr (step 0 gets
    max_lr/warmup_steps), then cosine decay reaching min_lr at total_steps, and min_lr after."""
    if warmup_steps > 0 and step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = (step - warmup_steps) / decay_steps
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
