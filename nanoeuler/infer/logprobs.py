"""Log-probabilities of chosen tokens and their best alternatives, from a row of logits on its own device.

They are the model's own distribution: log-softmax of head 0's raw logits, before temperature, top-k,
top-p or a grammar's mask change what is sampled (as vLLM reports them by default). The reduction runs
where the logits are (NumPy in float64, CuPy in the logits' float32); only `top` values cross to the host.

    >>> z = np.log(np.array([[0.5, 0.25, 0.25]]))
    >>> token_logprobs(z, [1], top=1)[0]
    (-1.3862943611198906, [(0, -0.6931471805599453)])
"""

from __future__ import annotations

import numpy as np


def log_softmax(z, xp=np):
    """Rows of logits -> rows of log-probabilities (float64 on NumPy)."""
    if xp is np:
        z = np.asarray(z, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - (m + xp.log(xp.exp(z - m).sum(axis=-1, keepdims=True)))


def token_logprobs(logits, tokens, top: int = 0) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of `logits` (n, V) and its chosen token: (its log-probability, the `top` most likely
    (id, log-probability), best first)."""
    xp = _module(logits)
    lp = log_softmax(logits, xp)
    rows = xp.arange(lp.shape[0])
    chosen = _host(lp[rows, xp.asarray(np.asarray(tokens, dtype=np.int64))])
    out = []
    if top > 0:
        best = xp.argpartition(-lp, min(top, lp.shape[1]) - 1, axis=1)[:, :top]
        vals = xp.take_along_axis(lp, best, axis=1)
        order = xp.argsort(-vals, axis=1, kind="stable") if xp is np else xp.argsort(-vals, axis=1)
        best, vals = _host(xp.take_along_axis(best, order, axis=1)), _host(xp.take_along_axis(vals, order, axis=1))
    for i in range(lp.shape[0]):
        alts = [(int(t), float(v)) for t, v in zip(best[i], vals[i])] if top > 0 else []
        out.append((float(chosen[i]), alts))
    return out


def _module(a):
    return np if isinstance(a, np.ndarray) else __import__("cupy").get_array_module(a)


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()
