"""Autoregressive generation with a KV cache: the reference `Generator`, and the commands' text helpers.

Each step's token is drawn by `sampling.sample_token`, which holds the sampling rules.

Context policy: the model sees at most `ctx_len` positions. A prompt longer than that is
left-truncated by the caller (`fit_prompt`). When generation fills the context, the cache is
rebuilt from the most recent `ctx_len // 2` tokens (one prefill) and generation goes on, so
`max_new_tokens` is always honoured; positions are relative (RoPE), so the model sees an
ordinary, shorter context.

`Generator` is the reference: the model's `xp` layers one token at a time. The commands generate
through the decode engine (`engine.DecodeEngine`, returned by `engine.load`), which is tested against it.
"""

from __future__ import annotations

import codecs
from typing import Iterable, Iterator

import numpy as np

from nanoeuler.infer.sampling import Sampling, sample_token


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
    `engine.DecodeEngine`)."""

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
