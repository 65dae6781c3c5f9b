"""The sampling rules applied to a row of logits, and the one check of sampling values.

Sampling happens on the host in float64 on one row of head-0 logits: temperature 0 is greedy (argmax);
otherwise logits / temperature, keep the `top_k` largest (0 = all), keep the smallest set of most likely
tokens whose probability reaches `top_p` (1.0 = all), renormalise and draw with the given
`numpy.random.Generator`. Speculative decoding adds one rule (`accept_or_resample`): a draft from another
distribution is kept or replaced so that the token's distribution is still exactly this one.

The reference `generate.Generator`, the decode engine and its backends, the grammar-guided streams and
the server all sample through these functions (the GPU's sampling kernel follows `sampling_probs`).

    >>> s = checked_sampling(0.0, 40, 0.95, 1)    # temperature 0: greedy
    >>> sample_token(np.log([0.1, 0.6, 0.3]), np.random.default_rng(s.seed), s.temperature, s.top_k, s.top_p)
    1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nanoeuler.backend import to_numpy
from nanoeuler.errors import UserError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0


# Below this temperature sampling is greedy: logits / T would overflow (float32 on the GPU) long before the
# draw could differ from the argmax (a logit gap of 1e-4 already leaves the runner-up exp(-100)).
MIN_TEMPERATURE = 1e-6
SEED_LIMIT = 2**63  # seeds are in [0, SEED_LIMIT): NumPy's generators refuse negative ones, int64 holds these


class SamplingError(ValueError):
    """A sampling value the sampler cannot work with; `field` names it (temperature, top_k, top_p, seed)."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field


def checked_sampling(temperature, top_k, top_p, seed) -> Sampling:
    """A `Sampling` from values as they arrive (command line, config, HTTP request), the one check of them all:
    numbers finite and where the sampler works, else a SamplingError. Under MIN_TEMPERATURE is greedy (0).

        >>> checked_sampling(float("nan"), 0, 1.0, 0)
        Traceback (most recent call last):
        nanoeuler.infer.sampling.SamplingError: nan is not a finite number >= 0
        >>> checked_sampling(5e-324, 0, 1.0, 0).temperature
        0.0
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise SamplingError("temperature", f"{temperature} is not a finite number >= 0")
    if top_k < 0:
        raise SamplingError("top_k", f"{top_k} is below 0 (0 keeps every token)")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise SamplingError("top_p", f"{top_p} is not a number in (0, 1]")
    if not 0 <= seed < SEED_LIMIT:
        raise SamplingError("seed", f"{seed} is outside [0, 2**63)")
    return Sampling(0.0 if temperature < MIN_TEMPERATURE else float(temperature), int(top_k), float(top_p), int(seed))


def sampling_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution that sampling draws from: (V,) float64 probabilities for a row of logits (temperature > 0).

    >>> sampling_probs(np.log([0.5, 0.3, 0.2]), 1.0, top_k=2).round(3).tolist()
    [0.625, 0.375, 0.0]
    """
    z = np.asarray(to_numpy(logits), dtype=np.float64).reshape(-1)
    z = z / temperature
    if 0 < top_k < z.shape[0]:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - np.max(z))
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep tokens until the cumulative probability first reaches top_p (the best one always stays)
        n_keep = int(np.searchsorted(cum, top_p, side="left")) + 1
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:n_keep]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def sample_token(logits, rng: np.random.Generator, temperature: float, top_k: int = 0, top_p: float = 1.0) -> int:
    """One token id from a (V,) row of logits (NumPy or CuPy)."""
    if temperature <= 0:
        return int(np.argmax(to_numpy(logits).reshape(-1)))
    p = sampling_probs(logits, temperature, top_k, top_p)
    return int(rng.choice(p.shape[0], p=p))


def accept_or_resample(p: np.ndarray, q: np.ndarray, draft: int, u: float, rng) -> tuple[bool, int]:
    """One speculative-sampling decision: (accepted?, token). p, q: target and draft distributions.

    Accept the draft with probability min(1, p/q); else draw from max(0, p - q) renormalised.
        >>> accept_or_resample(np.array([.5, .5]), np.array([1., 0.]), 0, 0.7, None)
        (False, 1)
    """
    if u * q[draft] < p[draft]:
        return True, draft
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    if total <= 0:  # p == q up to rounding: nothing to correct, the target itself is the residual
        r, total = p, p.sum()
    if rng is None:
        return False, int(np.argmax(r))
    return False, int(rng.choice(r.shape[0], p=r / total))


# ---- sampling values from the command line ------------------------------------------------------------


def add_sampling_arguments(parser) -> None:
    """--max-new-tokens/--temperature/--top-k/--top-p/--seed; unset ones come from the config's `eval`."""
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass (1 = all)")
    parser.add_argument("--seed", type=int, help="random seed of the sampler")


def sampling_from(args, eval_section: dict) -> tuple[Sampling, int]:
    """(Sampling, max_new_tokens): command-line values, else the config's eval section (`checked_sampling`)."""

    def pick(name, key):
        value = getattr(args, name, None)
        return eval_section[key] if value is None else value

    try:
        s = checked_sampling(
            float(pick("temperature", "temperature")),
            int(pick("top_k", "top_k")),
            float(pick("top_p", "top_p")),
            int(pick("seed", "seed")),
        )
    except SamplingError as exc:
        raise UserError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    n = int(pick("max_new_tokens", "max_new_tokens"))
    if n < 0:
        raise UserError(f"--max-new-tokens: {n} is below 0")
    return s, n
