"""Autoregressive generation with a KV cache, and the sampling rules applied to each step's logits.

Sampling happens on the host in float64 on one row of head-0 logits:
temperature 0 is greedy (argmax); otherwise logits / temperature, keep the `top_k` largest
(0 = all), keep the smallest set of most likely tokens whose probability reaches `top_p`
(1.0 = all), renormalise and draw with the given `numpy.random.Generator`.

Context policy: the model sees at most `ctx_len` positions. A prompt longer than that is
left-truncated by the caller (`fit_prompt`). When generation fills the context, the cache is
rebuilt from the most recent `ctx_len // 2` tokens (one prefill) and generation goes on, so
`max_new_tokens` is always honoured; positions are relative (RoPE), so the model sees an
ordinary, shorter context.

`Generator` is the reference: the model's `xp` layers one token at a time. The commands generate
through the decode engine (`infer.engine`, returned by `load`), which is tested against it.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from nanoeuler.backend import to_numpy


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
        nanoeuler.infer.generate.SamplingError: nan is not a finite number >= 0
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


def decode_stream(tok, ids: Iterable[int]) -> Iterator[str]:
    """Text pieces for token ids as they arrive. Bytes go through an incremental UTF-8 decoder, so a
    character split across tokens is printed once its last byte arrives (invalid bytes become U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in ids:
        piece = decoder.decode(tok.decode_bytes([t]))
        if piece:
            yield piece
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


def fit_prompt(ids: list[int], ctx_len: int, room: int) -> tuple[list[int], int]:
    """Left-truncate a prompt so `room` new tokens fit in the context: (kept ids, tokens dropped)."""
    limit = max(1, ctx_len - max(0, room))
    if len(ids) <= limit:
        return list(ids), 0
    return list(ids[-limit:]), len(ids) - limit


class Generator:
    """Holds a model on its device and generates from token prompts with a KV cache (the reference for
    `infer.engine`)."""

    def __init__(self, params: dict, cfg, xp=None):
        from nanoeuler.backend import array_module

        self.cfg = cfg
        self.xp = xp or array_module(next(iter(params.values())))
        self.params = {k: self.xp.asarray(v) for k, v in params.items()}
        self.dtype = self.params["lm_head.weight"].dtype

    def _prefill(self, ids: list[int]):
        from nanoeuler.model import transformer

        cache = transformer.new_kv_cache(self.cfg, 1, self.cfg.ctx_len, self.xp, self.dtype)
        x = self.xp.asarray(np.asarray(ids, dtype=np.int64)[None, :])
        logits = transformer.forward_step(self.params, x, cache, self.cfg)
        return cache, logits[0, -1]

    def stream(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop_ids: set[int] | frozenset = frozenset(),
    ) -> Iterator[int]:
        """Yield new token ids one at a time; stops after a stop id (which is yielded) or max tokens."""
        from nanoeuler.model import transformer

        if max_new_tokens <= 0:
            return
        ctx = self.cfg.ctx_len
        if not prompt_ids:
            raise ValueError("generation needs at least one prompt token")
        history = list(prompt_ids[-ctx:])
        rng = np.random.default_rng(sampling.seed)
        cache, last = self._prefill(history)
        for i in range(max_new_tokens):
            tok = sample_token(last, rng, sampling.temperature, sampling.top_k, sampling.top_p)
            yield tok
            if tok in stop_ids or i == max_new_tokens - 1:
                return
            history.append(tok)
            if cache.length >= ctx:
                history = history[-max(1, ctx // 2) :]
                cache, last = self._prefill(history)
            else:
                x = self.xp.asarray(np.array([[tok]], dtype=np.int64))
                last = transformer.forward_step(self.params, x, cache, self.cfg)[0, -1]

    def generate(self, prompt_ids, max_new_tokens, sampling, stop_ids=frozenset()) -> list[int]:
        return list(self.stream(prompt_ids, max_new_tokens, sampling, stop_ids))


def load(path, device: str = "auto", speculative: bool | None = None, gpu_memory="auto", stage: str = "sample",
         threads: int | None = None):
    """(decode `Engine` on `device`, Tokenizer, metadata) from a model file that carries its tokenizer.
    On the GPU the engine runs bf16 weights (the float32 ones stay in `engine.params`), and `gpu_memory`
    (the config key) caps the rows it decodes at once (`Engine.max_batch`, `memory.decode_batch`); on the
    CPU it uses up to `threads` BLAS threads (default: the usable cores; `--threads`)."""
    from nanoeuler import checkpoint, memory
    from nanoeuler.backend import resolve_device
    from nanoeuler.errors import UserError
    from nanoeuler.infer.engine import Engine
    from nanoeuler.tokenizer.bpe import Tokenizer

    params, cfg, meta = checkpoint.load_model(path)
    if not meta.get("tokenizer"):
        raise UserError(f"{path} carries no tokenizer (metadata 'tokenizer'); use a file written by "
                        "pretrain or sft")
    try:
        tok = Tokenizer.from_json(meta["tokenizer"])
    except UserError as exc:
        raise UserError(f"{path}: its tokenizer is unreadable: {exc}") from None
    device = resolve_device(device)
    xp = np if device == "cpu" else __import__("cupy")
    meter = memory.PeakMeter(xp)
    budget = memory.Budget.on_device(gpu_memory, xp)  # before this model's weights take their share
    engine = Engine.from_params(params, cfg, device, speculative=speculative, threads=threads)
    engine.budget, engine.meter = budget, meter
    engine.max_batch = memory.decode_batch(stage, budget, cfg, DECODE_ROWS_MOST)
    return engine, tok, meta


DECODE_ROWS_MOST = 256  # generation slots at most, whatever the memory holds


def add_sampling_arguments(parser) -> None:
    """--max-new-tokens/--temperature/--top-k/--top-p/--seed; unset ones come from the config's `eval`."""
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass (1 = all)")
    parser.add_argument("--seed", type=int, help="random seed of the sampler")


def add_threads_argument(parser) -> None:
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads of the NumPy engine: its prefills use them, its one-row decode steps "
                             "use them or one, whichever it measures faster; default: the usable cores")


def sampling_from(args, eval_section: dict) -> tuple[Sampling, int]:
    """(Sampling, max_new_tokens): command-line values, else the config's eval section (`checked_sampling`)."""
    from nanoeuler.errors import UserError

    def pick(name, key):
        value = getattr(args, name, None)
        return eval_section[key] if value is None else value

    try:
        s = checked_sampling(float(pick("temperature", "temperature")), int(pick("top_k", "top_k")),
                             float(pick("top_p", "top_p")), int(pick("seed", "seed")))
    except SamplingError as exc:
        raise UserError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    n = int(pick("max_new_tokens", "max_new_tokens"))
    if n < 0:
        raise UserError(f"--max-new-tokens: {n} is below 0")
    return s, n
