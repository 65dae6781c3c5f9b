"""The model behind the server: the one adapter between the HTTP layer and the generation engine.

The server asks three things of an engine: the tokenizer, a token stream per request (`open`), and a
batch step that advances many streams by one token each (`step`). Only this module knows which engine
answers; `infer.generate.load` decides, and two kinds are handled:

- a generator with a `stream(prompt, n, sampling, stop_ids)` iterator and nothing shared between
  streams (the reference `Generator`, one sequence per forward pass): a step advances the streams one
  after another;
- a decode engine whose `backend` holds cache slots (`start(batch, seeds)`, `prefill(slot, ids)`,
  `decode(tokens, pos, sampling, step, rngs, mask)`): each stream owns a slot from open to close, its
  prompt is prefilled into it, and a step feeds every stream's last token in one `decode` per distinct
  sampling setting (continuous batching: requests join and leave between steps).

Beyond the next token, a stream on a slot engine may ask for its log-probabilities (`logprobs`: the chosen
token's and its best alternatives', `infer.logprobs`) and follow a grammar (`guide`, `structured.Guide`: the
tokens it refuses are masked before sampling); such streams are decoded through the engine's
`decode_logits`, the others through its `decode`, which samples the same tokens from the same seeds.
Prompts that share a prefix with a recent one (a system prompt, the chat template's head) copy that
prefix's cache rows instead of computing them again (`PrefixCache`, where the engine can).

A stream's failure is its own: `step` gives the exception in that stream's place (the stream is done,
its slot goes back when it is closed) and the other streams go on as if it had never been there.

    >>> backend = Backend.load("results/chat.bin", device="cpu")
    >>> a = backend.open(backend.tok.encode("Once"), max_new_tokens=2, sampling=Sampling(temperature=0))
    >>> b = backend.open(backend.tok.encode("It was"), max_new_tokens=1, sampling=Sampling(temperature=0))
    >>> ids = backend.step([a, b])   # one token id for each stream
    >>> a.done, b.done               # b has reached its one token
    (False, True)
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import numpy as np

from nanoeuler.backend import to_numpy
from nanoeuler.errors import UserError
from nanoeuler.infer.generate import Sampling, load, sample_token
from nanoeuler.infer.logprobs import token_logprobs

__all__ = ["Backend", "PrefixCache", "Sampling", "TokenStream"]


class TokenStream:
    """One request's generation: `done` after a stop id or its last token; `close` lets go of its state."""

    def __init__(self, max_new_tokens: int, stop_ids: frozenset[int], tokens: Iterator[int] | None = None,
                 logprobs: int | None = None, guide=None):
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.logprobs, self.guide = logprobs, guide  # alternatives per token (None: none asked); a grammar
        self.records: list = []  # with `logprobs`: (log-probability, [(id, log-probability)...]) per token
        self.generated = 0
        self.done = max_new_tokens <= 0
        self._tokens = tokens  # the iterator of a stream-per-request engine
        self.slot: int | None = None  # the cache slot on a slot engine, and its state:
        self.history: list[int] = []  # the tokens in the slot (prompt, then answer)
        self.pending: int | None = None  # the next token, chosen and not yet handed out
        self.pos = 0  # where `pending` will be fed
        self.sampling: Sampling | None = None
        self.release = None

    def record(self, token: int) -> int:
        self.generated += 1
        self.done = (token in self.stop_ids or self.generated >= self.max_new_tokens
                     or (self.guide is not None and self.guide.stopped))
        return token

    def advance(self) -> int:
        return self.record(next(self._tokens))

    def close(self) -> None:
        self.done = True
        try:
            if self._tokens is not None:
                self._tokens.close()
        finally:  # the slot goes back whatever the engine's iterator did
            if self.release is not None:
                release, self.release = self.release, None
                release(self)


class Backend:
    """A chat model file, loaded once: its tokenizer, context length and token streams.
    `slots`: most streams open at once on a slot engine (the scheduler's `max_batch`)."""

    def __init__(self, engine, tok, name: str, slots: int = 8, prefix_cache: int = 8):
        self.engine, self.tok, self.name = engine, tok, name
        self.stop_ids = frozenset({tok.end_id, tok.eot_id})
        be = getattr(engine, "backend", None)
        self._slots = _slots(be, engine.cfg, slots) if all(
            hasattr(be, m) for m in ("start", "prefill", "decode")) else None
        reuses = all(hasattr(be, m) for m in ("prefill_from", "read_rows", "write_rows"))
        if self._slots and prefix_cache > 0 and reuses:
            self._slots.prefixes = PrefixCache(be, prefix_cache)
        self.capacity = slots if self._slots else None

    @classmethod
    def load(cls, path, device: str = "auto", name: str | None = None, slots: int = 8,
             gpu_memory="auto", threads: int | None = None, prefix_cache: int = 8) -> "Backend":
        """`slots` at most as many as the GPU's memory holds caches for (`gpu_memory`, `memory.decode_batch`).
        A release folder serves its model file, under that file's name (`chat`)."""
        from nanoeuler.checkpoint import model_file

        path = model_file(path)
        engine, tok, _ = load(path, device, gpu_memory=gpu_memory, stage="serve", threads=threads)
        if engine.max_batch is not None and slots > engine.max_batch:
            print(f"nanoeuler serve: max_batch {engine.max_batch} (not {slots}): the KV caches of that many streams "
                  f"fit {engine.budget.total / 1e9:.1f} GB ({engine.budget.source})", file=sys.stderr, flush=True)
            slots = engine.max_batch
        return cls(engine, tok, name or Path(path).stem, slots, prefix_cache)

    @property
    def cfg(self):
        return self.engine.cfg

    @property
    def free_slots(self) -> int | None:
        """Cache slots no stream holds (None on an engine without slots); `capacity` when idle."""
        return len(self._slots.free) if self._slots else None

    @property
    def prefixes(self) -> "PrefixCache | None":
        """The cache of recent prompts' rows (None where the engine cannot reuse them, or it is off)."""
        return self._slots.prefixes if self._slots else None

    @property
    def ctx_len(self) -> int:
        return self.engine.cfg.ctx_len

    def open(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
             stop_at_end: bool = True, logprobs: int | None = None, guide=None) -> TokenStream:
        """A stream for one prompt; nothing is computed until its first `step` (the prefill).
        `stop_at_end=False` goes on past `</s>` and `<|endoftext|>` (fixed-length answers for load tests).
        `logprobs`: record each token's log-probability and that many alternatives; `guide`: a grammar."""
        stop_ids = self.stop_ids if stop_at_end else frozenset()
        if self._slots is None:
            if logprobs is not None or guide is not None:
                raise RuntimeError("log-probabilities and grammars need an engine with cache slots")
            tokens = self.engine.stream(prompt_ids, max_new_tokens, sampling, stop_ids)
            return TokenStream(max_new_tokens, stop_ids, tokens)
        stream = TokenStream(max_new_tokens, stop_ids, logprobs=logprobs, guide=guide)
        self._slots.take(stream, prompt_ids, sampling)
        return stream

    def step(self, streams: list[TokenStream]) -> list[int | Exception]:
        """The batch entry: the next token of every stream (none of them may be `done`), or in its place the
        exception that ended that stream alone."""
        if self._slots is None:
            return [_own(s, s.advance) for s in streams]
        return self._slots.step(streams)


def _own(stream: TokenStream, work):
    """work()'s result, or the exception it raised, which ends `stream` (and only it)."""
    try:
        return work()
    except Exception as exc:
        stream.done = True
        return exc


def _slots(be, cfg, n: int) -> "_Slots":
    """`n` slots, or a UserError when their caches cannot fit: counted at 2 bytes a value (bf16, the least
    any backend keeps) against this machine's memory first, then whatever the allocation itself refuses."""
    need = n * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.ctx_len * cfg.head_dim * 2
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise UserError(f"--max-batch {n}: the caches of {n} generation slots need {need / 2**30:.1f} GiB or "
                        f"more; this machine has {have / 2**30:.1f} GiB")
    try:
        return _Slots(be, cfg, n)
    except MemoryError as exc:  # NumPy's, and CuPy's OutOfMemoryError
        raise UserError(f"--max-batch {n}: the caches of {n} generation slots do not fit in memory ({exc})") from None


class _Slots:
    """Continuous batching on a slot engine: a stream holds one of `n` cache slots while it is open."""

    def __init__(self, be, cfg, n: int):
        self.be, self.cfg, self.n = be, cfg, n
        self.free = list(range(n - 1, -1, -1))
        self.seeds = [0] * n
        self.rngs = [np.random.default_rng(0) for _ in range(n)]
        self.tokens = np.zeros(n, dtype=np.int64)
        self.pos = np.zeros(n, dtype=np.int64)
        self.decodes = 0
        self.prefixes: PrefixCache | None = None
        be.start(n, self.seeds)

    def take(self, stream: TokenStream, prompt_ids: list[int], sampling: Sampling) -> None:
        if not self.free:
            raise RuntimeError(f"all {self.n} generation slots are taken")
        rng = np.random.default_rng(sampling.seed)  # first: a seed it refuses must not hold a slot
        slot = self.free.pop()
        try:
            self.seeds[slot] = sampling.seed
            self.be.start(self.n, self.seeds)  # same shape: the caches stay, the slot's sampler is reseeded
        except BaseException:
            self.seeds[slot] = 0
            self.free.append(slot)
            raise
        self.rngs[slot] = rng
        stream.slot, stream.sampling, stream.release = slot, sampling, self._give_back
        stream.history = list(prompt_ids[-self.cfg.ctx_len:])

    def _give_back(self, stream: TokenStream) -> None:
        self.free.append(stream.slot)

    def _prefill(self, s: TokenStream) -> None:
        """Fill the slot with the stream's history (after the rows of a cached prefix, if any); its next token
        comes from the last position's logits."""
        reused = self.prefixes.reuse(s.slot, s.history) if self.prefixes else 0
        heads = self.be.prefill_from(s.slot, s.history, reused) if reused else self.be.prefill(s.slot, s.history)
        if self.prefixes:
            self.prefixes.keep(s.slot, s.history, reused)
        s.pending = self._choose([s], heads[:1])[0]
        s.pos = len(s.history)

    def _choose(self, streams: list[TokenStream], logits) -> list[int]:
        """The next token of each stream from its row of head-0 logits: sampled from its own seed stream,
        among the tokens its grammar allows; its log-probabilities recorded when asked for."""
        out = []
        for s, row in zip(streams, logits):
            t = s.sampling
            if s.guide is not None:
                allowed = s.guide.allowed()
                if not allowed.any():
                    raise RuntimeError("the grammar allows no token here")
                row = np.where(allowed, np.asarray(to_numpy(row), dtype=np.float64), -np.inf)
            out.append(sample_token(row, self.rngs[s.slot], t.temperature, t.top_k, t.top_p))
            if s.guide is not None:
                s.guide.consume(out[-1])
        asked = [i for i, s in enumerate(streams) if s.logprobs is not None]
        if asked:
            top = max(streams[i].logprobs for i in asked)
            rows = logits[asked] if len(asked) < len(streams) else logits
            for i, (lp, alts) in zip(asked, token_logprobs(rows, [out[i] for i in asked], top)):
                streams[i].records.append((lp, alts[:streams[i].logprobs]))
        return out

    def step(self, streams: list[TokenStream]) -> list[int | Exception]:
        """`Backend.step` on slots: prefill the new streams, hand out every pending token, decode the next ones
        (one call per sampling setting). A stream's own failure takes its token's place in `out`."""
        out = {id(s): _own(s, lambda s=s: self._prefill(s)) for s in streams if s.pending is None}
        feed = []
        for s in streams:
            if isinstance(out.get(id(s)), Exception):
                continue
            t = out[id(s)] = s.record(s.pending)
            s.history.append(t)
            if s.done:
                continue
            if s.pos >= self.cfg.ctx_len:  # the slot is full: refill it from the newest tokens
                s.history = s.history[-max(1, self.cfg.ctx_len // 2):]
                refilled = _own(s, lambda s=s: self._prefill(s))
                out[id(s)] = refilled if isinstance(refilled, Exception) else t
            else:
                feed.append(s)
        groups: dict[tuple, list[TokenStream]] = {}
        for s in feed:
            key = (s.sampling.temperature, s.sampling.top_k, s.sampling.top_p, _needs_logits(s))
            groups.setdefault(key, []).append(s)
        for group in groups.values():
            try:
                self._decode(feed, group)
            except Exception as exc:  # the group shares its sampling setting: what failed is theirs
                for s in group:
                    s.done, out[id(s)] = True, exc
        return [out[id(s)] for s in streams]

    def _decode(self, feed: list[TokenStream], group: list[TokenStream]) -> None:
        """One decode call for `group`. An engine may compute the rows outside the mask too, writing their
        keys/values: so every fed slot carries its true (token, position), where it writes what it will
        write when fed, and every other row the last position, which a slot writes before it reads."""
        self.tokens[:], self.pos[:] = 0, self.cfg.ctx_len - 1  # rows not fed: a position no slot has read yet
        for s in feed:
            self.tokens[s.slot], self.pos[s.slot] = s.pending, s.pos
        mask = np.zeros(self.n, dtype=bool)
        mask[[s.slot for s in group]] = True
        pos = np.minimum(self.pos, self.cfg.ctx_len - 1)
        if _needs_logits(group[0]):  # rows come back in slot order
            group = sorted(group, key=lambda s: s.slot)
            nxt = dict(zip((s.slot for s in group),
                           self._choose(group, self.be.decode_logits(self.tokens.copy(), pos, mask))))
        else:
            nxt = self.be.decode(self.tokens.copy(), pos, group[0].sampling, self.decodes, self.rngs, mask)
        self.decodes += 1
        for s in group:
            s.pending, s.pos = int(nxt[s.slot]), s.pos + 1


def _needs_logits(s: TokenStream) -> bool:
    return s.logprobs is not None or s.guide is not None


class PrefixCache:
    """The cache rows of the last `entries` prompts, keyed by their token ids. A new prompt takes the rows of
    its longest common prefix with any of them (at least `min_tokens`; its last token is always computed, for
    its logits): a copy, where computing them would cost a forward pass over every one.

        >>> cache = PrefixCache(cpu_backend, entries=8)                        # doctest: +SKIP
        >>> n = cache.reuse(slot, ids)   # the slot's rows 0..n-1 now hold ids[:n]  # doctest: +SKIP
    """

    def __init__(self, be, entries: int = 8, min_tokens: int = 8):
        self.be, self.size, self.min_tokens = be, entries, min_tokens
        self.entries: OrderedDict[tuple, list] = OrderedDict()  # oldest use first
        self.hits = self.tokens = 0  # prompts that reused rows, and the rows reused

    def reuse(self, slot: int, ids: list[int]) -> int:
        """Copy the longest cached prefix of `ids` into `slot`; the number of positions copied (0: none)."""
        best, n = None, 0
        for key in self.entries:
            m = _common(key, ids)
            if m > n:
                best, n = key, m
        n = min(n, len(ids) - 1)
        if n < self.min_tokens:
            return 0
        self.entries.move_to_end(best)
        self.be.write_rows(slot, self.entries[best], n)
        self.hits += 1
        self.tokens += n
        return n

    def keep(self, slot: int, ids: list[int], reused: int) -> None:
        """Remember `slot`'s rows of the prompt `ids` just prefilled (unless a cached entry covers them)."""
        if len(ids) < self.min_tokens or reused >= len(ids) - 1:
            return
        key = tuple(ids)
        for old in [k for k in self.entries if len(k) <= len(key) and key[:len(k)] == k]:
            del self.entries[old]  # a prefix of this prompt: its rows are among these
        self.entries[key] = self.be.read_rows(slot, len(key))
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


def _common(a, b) -> int:
    """The length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n
