"""The model behind the server: the one adapter between the HTTP layer and the generation engine.

The server asks three things of an engine: the tokenizer, a token stream per request (`open`), and a
batch step that advances many streams by one token each, or by more where speculation kept drafts (`step`).
Only this module knows which engine answers; `infer.engine.load` decides, and two kinds are handled:

- a generator with a `stream(prompt, n, sampling, stop_ids)` iterator and nothing shared between
  streams (the reference `Generator`, one sequence per forward pass): a step advances the streams one
  after another;
- a decode engine whose `backend` holds cache slots (`start(batch, seeds)`, `prefill(slot, ids)`,
  `decode(tokens, pos, sampling, step, rngs, mask)`): each stream owns a slot from open to close (the
  lowest free one), its prompt is prefilled into it (the prompts of streams that join at the same step
  together, `prefill_many`, where the engine has it), and a step feeds every stream's last token in one
  `decode` per distinct sampling setting (continuous batching: requests join and leave between steps),
  over the slots up to the highest one fed, rounded up to a power of two. When every fed stream is plain
  greedy, the steps feed themselves instead (`greedy_chain`, the GPU's: up to 3 queued ahead of the host),
  and a step hands out the tokens of every step that has landed; the chain runs while the batch keeps its
  streams. A new plain greedy stream joins it in a row whose stream has ended (`join`: its prompt's pass
  queued between the chain's steps, its first token chosen on the device, so the chain never waits for
  the host); any other new or refilled stream drains it (its tokens handed out) before being prefilled.

Beyond the next token, a stream on a slot engine may ask for its log-probabilities (`logprobs`: the chosen
token's and its best alternatives', `infer.logprobs`) and follow a grammar (`guide`, `structured.Guide`: the
tokens it refuses are masked before sampling); such streams are decoded through the engine's
`decode_logits`, the others through its `decode`, which samples the same tokens from the same seeds.
Prompts that share a prefix with a recent one (a system prompt, the chat template's head) copy that
prefix's cache rows instead of computing them again (`PrefixCache`, where the engine can).

With `speculative`, greedy streams (without log-probabilities or a grammar) decode by self-speculation in
the batch: each keeps the drafts of its MTP heads, and one `verify_argmax_many` call checks every such
stream's block [next token, drafts] at once (`engine.greedy_kept`, the engine's rule for one prompt), so a
step hands such a stream 1 to K tokens, token for token plain greedy's. The passes are counted per draft
head in the engine's `SpecStats` (`/metrics`). Sampled streams, and streams within K positions of the
context's end, decode plainly.

A stream's failure is its own: `step` gives the exception in that stream's place (the stream is done,
its slot goes back when it is closed) and the other streams go on as if it had never been there.

    >>> backend = Backend.load("results/chat.bin", device="cpu")                      # doctest: +SKIP
    >>> greedy = Sampling(temperature=0)                                              # doctest: +SKIP
    >>> a = backend.open(backend.tok.encode("Once"), max_new_tokens=2, sampling=greedy)    # doctest: +SKIP
    >>> b = backend.open(backend.tok.encode("It was"), max_new_tokens=1, sampling=greedy)  # doctest: +SKIP
    >>> ids = backend.step([a, b])   # the new token ids of each stream             # doctest: +SKIP
    >>> [len(t) for t in ids], a.done, b.done   # b has reached its one token       # doctest: +SKIP
    ([1, 1], False, True)
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import numpy as np

from nanoeuler.backend import to_numpy
from nanoeuler.errors import UserError
from nanoeuler.infer.engine import greedy_kept, load
from nanoeuler.infer.logprobs import token_logprobs
from nanoeuler.infer.sampling import Sampling, sample_token
from nanoeuler.kernels.decode import plan

__all__ = ["Backend", "PrefixCache", "Sampling", "TokenStream"]

JOINED = -1  # the pending token of a stream that joined a running chain, until that chain's steps feed it


class TokenStream:
    """One request's generation: `done` after a stop id or its last token; `close` lets go of its state."""

    def __init__(
        self,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        tokens: Iterator[int] | None = None,
        logprobs: int | None = None,
        guide=None,
    ):
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.logprobs, self.guide = logprobs, guide  # alternatives per token (None: none asked); a grammar
        self.records: list = []  # with `logprobs`: (log-probability, [(id, log-probability)...]) per token
        self.generated = 0
        self.done = max_new_tokens <= 0
        self._tokens = tokens  # the iterator of a stream-per-request engine
        self.slot: int | None = None  # the cache slot on a slot engine, and its state:
        self.history: list[int] = []  # the tokens in the slot (prompt, then answer)
        self.pending: int | None = None  # the next token, chosen and not yet handed out
        self.drafts: list[int] | None = None  # the draft heads' tokens after `pending` (a speculating stream)
        self.pos = 0  # where `pending` will be fed
        self.sampling: Sampling | None = None
        self.release = None

    def record(self, token: int) -> int:
        self.generated += 1
        self.done = (
            token in self.stop_ids
            or self.generated >= self.max_new_tokens
            or (self.guide is not None and self.guide.stopped)
        )
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
    `slots`: most streams open at once on a slot engine (the scheduler's `max_batch`). `speculative`: greedy
    streams speculate where the engine verifies blocks of several slots at once (`verify_argmax_many`)."""

    def __init__(
        self,
        engine,
        tok,
        name: str,
        slots: int = 8,
        prefix_cache: int = 8,
        speculative: bool = False,
    ):
        self.engine, self.tok, self.name = engine, tok, name
        self.stop_ids = frozenset({tok.end_id, tok.eot_id})
        self.token_bytes = _TokenBytes(tok)  # a token's bytes, looked up once (a stream asks for each token's)
        be = getattr(engine, "backend", None)
        self._slots = (
            _slots(be, engine.cfg, slots) if all(hasattr(be, m) for m in ("start", "prefill", "decode")) else None
        )
        if self._slots and speculative and engine.cfg.mtp_heads > 1 and hasattr(be, "verify_argmax_many"):
            self._slots.stats = engine.stats
            engine.stats.for_heads(engine.cfg.mtp_heads)
        reuses = all(hasattr(be, m) for m in ("prefill_from", "read_rows", "write_rows"))
        if self._slots and prefix_cache > 0 and reuses:
            self._slots.prefixes = PrefixCache(be, prefix_cache)
        self.capacity = slots if self._slots else None

    @classmethod
    def load(
        cls,
        path,
        device: str = "auto",
        name: str | None = None,
        slots: int = 8,
        gpu_memory="auto",
        threads: int | None = None,
        prefix_cache: int = 8,
        speculative: bool = False,
        warm_up: bool = True,
    ) -> "Backend":
        """`slots` at most as many as the GPU's memory holds caches for (`gpu_memory`, `memory.decode_batch`).
        A release folder serves its model file, under that file's name (`chat`). `warm_up`: where the engine
        records CUDA graphs, run `warm_up` before returning (the CPU's records nothing: nothing to warm)."""
        from nanoeuler.checkpoint import model_file

        path = model_file(path)
        engine, tok, _ = load(
            path, device, gpu_memory=gpu_memory, stage="serve", threads=threads, batch_speculation=speculative
        )
        if engine.max_batch is not None and slots > engine.max_batch:
            extra = " and their speculation's verify buffers" if speculative else ""
            print(
                f"nanoeuler serve: max_batch {engine.max_batch} (not {slots}): the KV caches of that many streams"
                f"{extra} fit {engine.budget.total / 1e9:.1f} GB ({engine.budget.source})",
                file=sys.stderr,
                flush=True,
            )
            slots = engine.max_batch
        backend = cls(engine, tok, name or Path(path).stem, slots, prefix_cache, speculative)
        if warm_up and getattr(getattr(engine, "backend", None), "use_graphs", False):
            start = time.perf_counter()
            streams = backend.warm_up()
            print(
                f"nanoeuler serve: warmed up in {time.perf_counter() - start:.1f} s ({streams} made-up streams at "
                f"batch widths up to {slots})",
                file=sys.stderr,
                flush=True,
            )
        return backend

    @property
    def cfg(self):
        return self.engine.cfg

    @property
    def free_slots(self) -> int | None:
        """Cache slots no stream holds (None on an engine without slots); `capacity` when idle."""
        return len(self._slots.free) if self._slots else None

    @property
    def speculative(self) -> bool:
        """Whether greedy streams speculate (asked for, and the engine can verify several slots at once)."""
        return bool(self._slots and self._slots.stats is not None)

    @property
    def prefixes(self) -> "PrefixCache | None":
        """The cache of recent prompts' rows (None where the engine cannot reuse them, or it is off)."""
        return self._slots.prefixes if self._slots else None

    @property
    def ctx_len(self) -> int:
        return self.engine.cfg.ctx_len

    def open(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop_at_end: bool = True,
        logprobs: int | None = None,
        guide=None,
    ) -> TokenStream:
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

    def step(self, streams: list[TokenStream]) -> list[list[int] | Exception]:
        """The batch entry: the new tokens of every stream (none of them may be `done`; one token, or up to K
        when a speculative pass kept drafts), or in their place the exception that ended that stream alone."""
        if self._slots is None:
            return [_own(s, lambda s=s: [s.advance()]) for s in streams]
        return self._slots.step(streams)

    def warm_up(self) -> int:
        """Serve made-up requests before the first real one, so that no request waits for what a GPU engine
        does on a shape's first two calls (compile and load kernels, let cuBLAS choose its algorithms,
        record the CUDA graph). Twice over: a prompt of each row count a prefill runs as
        (`plan.recorded_rows`: 1 to 16, then powers of two up to the context), alone, split between two
        streams (`prefill_many`), and one token past a cached prompt (prefix reuse); then greedy, sampled,
        log-probability and mixed batches at every decode width a step can take (`_Slots._rows`,
        `plan.decode_widths`; with speculation, greedy batches of every size, since a pass verifies any
        number of streams at once). Afterwards the backend is as loaded: every
        slot free, no prompt kept for reuse, counters, seeds and the step count as new, so a request is
        answered token for token as without it. Returns the streams run.

            >>> backend.warm_up()   # the 116M model (context 512), 32 slots: 21 row counts, 6 widths  # doctest: +SKIP
            628
        """
        return self._slots.warm_up() if self._slots else 0


class _TokenBytes(dict):
    """token id -> its bytes (`tok.decode_bytes([id])`), each decoded the first time it is asked for."""

    def __init__(self, tok):
        super().__init__()
        self.tok = tok

    def __missing__(self, token: int) -> bytes:
        raw = self[token] = self.tok.decode_bytes([token])
        return raw


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
        raise UserError(
            f"--max-batch {n}: the caches of {n} generation slots need {need / 2**30:.1f} GiB or "
            f"more; this machine has {have / 2**30:.1f} GiB"
        )
    try:
        return _Slots(be, cfg, n)
    except MemoryError as exc:  # NumPy's, and CuPy's OutOfMemoryError
        raise UserError(f"--max-batch {n}: the caches of {n} generation slots do not fit in memory ({exc})") from None


class _Slots:
    """Continuous batching on a slot engine: a stream holds one of `n` cache slots while it is open."""

    def __init__(self, be, cfg, n: int):
        self.be, self.cfg, self.n = be, cfg, n
        self.free = list(range(n))  # a heap: a new stream takes the lowest free slot (`_decode`'s rows)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.pos = np.zeros(n, dtype=np.int64)
        self.prefixes: PrefixCache | None = None
        self.stats = None  # the engine's SpecStats where greedy streams speculate
        self.chain = None  # greedy steps running ahead of the host (`_start_chain`), and the streams they feed
        self.chained: dict[int, TokenStream] = {}
        self.joining: dict[int, int] = {}  # slot -> the chain's step from which it feeds a stream that joined
        self._seed_all()

    def _seed_all(self) -> None:
        """Every slot's sampler seeded 0 and the step count at 0, as at the start (the engine's too)."""
        self.seeds, self.rngs, self.decodes = [0] * self.n, [np.random.default_rng(0) for _ in range(self.n)], 0
        self.be.start(self.n, self.seeds)

    WARM_PROMPT = 24  # a warm-up stream's prompt: alone, past the GPU's few-row path (16), as a chat prompt is
    GREEDY, HOT = Sampling(temperature=0), Sampling(temperature=1.0)
    # stream i of a warm-up batch takes kind[i % len(kind)]: (sampling, logprobs); each kind a rule of the step
    # (greedy alone: the chain; sampled; log-probabilities: decode_logits; greedy beside sampled: argmax)
    ALONE = ((GREEDY, None),)
    WARM_KINDS = (ALONE, ((HOT, None),), ((GREEDY, 1),), ((GREEDY, None), (HOT, None)))

    def warm_up(self) -> int:
        """`Backend.warm_up`: its prefills and steps twice (a shape's first call runs it, the second records
        its graph), then the state as new."""
        prefixes, counters = self.prefixes, self.stats and dataclasses.asdict(self.stats)
        try:
            return sum(self._warm_prefills(reuse=prefixes is not None) + self._warm_steps() for _ in range(2))
        finally:
            if self.chain is not None:  # steps queued past the streams' ends
                self._drain([], {})
            self.prefixes = prefixes
            for key, value in (counters or {}).items():
                setattr(self.stats, key, value)
            self._seed_all()

    def _warm_prefills(self, reuse: bool) -> int:
        """A prompt of every prefill row count, alone and split between two streams; with `reuse`, a prompt one
        token past a cached one (`prefill_from`'s one-row remainder; the others are prefill_many's)."""
        self.prefixes, ran = None, 0  # made-up prompts are not kept, nor reuse each other's rows
        for T in plan.recorded_rows(self.cfg.ctx_len):
            ran += self._warm_batch([T], self.ALONE, new=1)
            ran += self._warm_batch([T // 2, T - T // 2], self.ALONE, new=1) if T > 1 else 0
        if reuse:
            T0, self.prefixes = self._warm_prompt(), PrefixCache(self.be, 1)
            ran += self._warm_batch([T0], self.ALONE, new=1) + self._warm_batch([T0 + 1], self.ALONE, new=1)
            self.prefixes = None
        return ran

    def _warm_steps(self) -> int:
        """Each kind at every decode width (greedy streams that speculate: every count, a pass being g x K rows)."""
        ran = 0
        for kind in self.WARM_KINDS:
            every = self.stats is not None and kind == self.ALONE
            widths = range(1, self.n + 1) if every else plan.decode_widths(self.n)
            ran += sum(self._warm_batch([self._warm_prompt()] * w, kind) for w in widths if w >= len(kind))
        return ran

    def _warm_prompt(self) -> int:
        return min(self.WARM_PROMPT, self.cfg.ctx_len // 2)

    def _warm_batch(self, lengths: list[int], kind: tuple, new: int = 3) -> int:
        """Made-up streams with prompts of `lengths` tokens and `new` tokens each (stream i of `kind`'s
        (sampling, logprobs) i % len(kind)), opened at once (slots 0, 1, ...) and stepped to their ends; a
        failure is raised. Returns how many ran."""
        V = self.cfg.vocab_size
        kinds = [kind[i % len(kind)] for i in range(len(lengths))]
        streams = [TokenStream(new, frozenset(), logprobs=logprobs) for _, logprobs in kinds]
        try:
            for i, (s, T, (sampling, _)) in enumerate(zip(streams, lengths, kinds)):
                self.take(s, [(7 * i + j) % V for j in range(T)], sampling)
            while live := [s for s in streams if not s.done]:
                for got in self.step(live):
                    if isinstance(got, Exception):
                        raise got
        finally:
            for s in streams:
                s.close()
        return len(streams)

    def take(self, stream: TokenStream, prompt_ids: list[int], sampling: Sampling) -> None:
        if not self.free:
            raise RuntimeError(f"all {self.n} generation slots are taken")
        rng = np.random.default_rng(sampling.seed)  # first: a seed it refuses must not hold a slot
        slot = heapq.heappop(self.free)
        try:
            self.seeds[slot] = sampling.seed
            self.be.start(self.n, self.seeds)  # same shape: the caches stay, the slot's sampler is reseeded
        except BaseException:
            self.seeds[slot] = 0
            heapq.heappush(self.free, slot)
            raise
        self.rngs[slot] = rng
        stream.slot, stream.sampling, stream.release = slot, sampling, self._give_back
        stream.history = list(prompt_ids[-self.cfg.ctx_len :])

    def _give_back(self, stream: TokenStream) -> None:
        heapq.heappush(self.free, stream.slot)

    def _prefill_new(self, news: list[TokenStream]) -> dict:
        """Prefill the streams new to the batch: {id(stream): None, or the exception that ended it}. Each first
        takes the cache rows of its longest cached prefix (`PrefixCache.reuse`), then all go through the
        engine together from there (`prefill_many`: one pass and one wait, where each alone is one of each:
        requests arrive in bunches); if that fails, each is tried alone, so a failure stays its own stream's."""
        done, starts = {}, {}
        for s in news:
            got = _own(s, lambda s=s: self.prefixes.reuse(s.slot, s.history) if self.prefixes else 0)
            (done if isinstance(got, Exception) else starts)[id(s)] = got
        together = [s for s in news if id(s) in starts]
        if len(together) > 1 and hasattr(self.be, "prefill_many"):
            try:
                heads = self.be.prefill_many(
                    [s.slot for s in together], [s.history for s in together], [starts[id(s)] for s in together]
                )
            except Exception:
                heads = ()
            for s, h in zip(together, heads):
                done[id(s)] = _own(s, lambda s=s, h=h: self._prefill(s, h, starts[id(s)]))
        for s in news:
            if id(s) not in done:
                done[id(s)] = _own(s, lambda s=s: self._prefill(s, reused=starts[id(s)]))
        return done

    def _prefill(self, s: TokenStream, heads=None, reused: int | None = None) -> None:
        """Fill the slot with the stream's history after the rows of its longest cached prefix (`reused` of them
        already copied, where given), or take `heads`, its logits from a prefill already done (`_prefill_new`);
        its next token comes from the last position's logits."""
        if reused is None:
            reused = self.prefixes.reuse(s.slot, s.history) if self.prefixes else 0
        if heads is None:
            heads = _prefill_from(self.be, s.slot, s.history, reused)
        if self.prefixes:
            self.prefixes.keep(s.slot, s.history, reused)
        s.pending = self._choose([s], heads[:1])[0]
        s.pos = len(s.history)
        speculates = self.stats is not None and s.sampling.temperature <= 0 and not _needs_logits(s)
        s.drafts = [int(np.argmax(to_numpy(h))) for h in heads[1:]] if speculates else None

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
                streams[i].records.append((lp, alts[: streams[i].logprobs]))
        return out

    def step(self, streams: list[TokenStream]) -> list[list[int] | Exception]:
        """`Backend.step` on slots: go on with the greedy chain while it feeds these very streams, else drain
        it; prefill the new streams, hand out every pending token, decode the next ones (a chain when every
        fed stream is plain greedy, else one call per sampling setting), then verify the speculating
        streams' drafts (one call for all; the drafts kept are handed out too). A stream's own failure takes
        its tokens' place in `out`."""
        out: dict = {id(s): [] for s in streams}
        news = [s for s in streams if s.pending is None]
        if self.chain is not None:
            if news and self._join(news, out):
                news = []
            if not news and self._chain_holds(streams):
                self._chain_next(streams, out)
                return [out[id(s)] for s in streams]
            self.chain.stop()  # the new prompts' prefill queues after its last steps
        failed = self._prefill_new(news)
        if self.chain is not None:
            self._drain(streams, out)
        feed = []
        for s in streams:
            if isinstance(failed.get(id(s)), Exception):
                out[id(s)] = failed[id(s)]
                continue
            if s.done:  # it ended among the tokens the drained chain handed out
                continue
            t = s.record(s.pending)
            out[id(s)].append(t)
            s.history.append(t)
            if s.done:
                continue
            if s.pos >= self.cfg.ctx_len:  # the slot is full: refill it from the newest tokens
                s.history = s.history[-max(1, self.cfg.ctx_len // 2) :]
                refilled = _own(s, lambda s=s: self._prefill(s))
                if isinstance(refilled, Exception):
                    out[id(s)] = refilled
            else:
                feed.append(s)
        groups: dict[tuple, list[TokenStream]] = {}
        for s in feed:  # the verifying group last: plain decodes then see its streams' rows as they stand
            verifies = s.drafts is not None and s.pos + self.cfg.mtp_heads <= self.cfg.ctx_len
            key = (verifies, s.sampling.temperature, s.sampling.top_k, s.sampling.top_p, _needs_logits(s))
            groups.setdefault(key, []).append(s)
        if feed and all(not k[0] and k[1] <= 0 and not k[4] for k in groups):  # every fed stream plain greedy
            groups = {"chain": feed}
        for key in sorted(groups, key=lambda k: k[0]):
            group = groups[key]
            try:
                if key == "chain":
                    self._start_chain(group)
                elif key[0]:
                    self._verify(group, out)
                else:
                    self._decode(feed, group)
            except Exception as exc:  # the group shares its sampling setting: what failed is theirs
                for s in group:
                    s.done, out[id(s)] = True, exc
        return [out[id(s)] for s in streams]

    # ---- the greedy chain: steps queued ahead on the device, which feed themselves ----------------------

    def _start_chain(self, feed: list[TokenStream]) -> None:
        """Decode `feed`'s next tokens with greedy steps that feed themselves (the engine's `greedy_chain`;
        an engine without one decodes them a step at a time), up to the first stream's end of context or
        the last one's last token, and take the first step's tokens as `_decode` would."""
        tokens, pos, mask = self._rows(feed)
        steps = min(min(self.cfg.ctx_len - s.pos for s in feed), max(s.max_new_tokens - s.generated for s in feed))
        make = getattr(self.be, "greedy_chain", None)
        self.chain = make(tokens, pos, steps) if make else _Stepwise(self.be, tokens, pos, steps, mask, self.rngs)
        self.chained, self.joining = {s.slot: s for s in feed}, {}
        try:
            ids = self.chain.next()
        except BaseException:  # the group fails (`step`), and no chain is left behind
            self.chain, self.chained = None, {}
            raise
        for s in feed:
            s.pending, s.pos, s.drafts = int(ids[s.slot]), s.pos + 1, None

    def _chain_holds(self, streams: list[TokenStream]) -> bool:
        """Whether the chain can go on for `streams`: each of them is fed by it (no new or refilled stream;
        one that has ended is simply not asked for: its row runs on, writing only its own slot's cache
        past its end, which the slot's next prompt overwrites) and it has steps left."""
        return self.chain.left() and all(self.chained.get(s.slot) is s for s in streams)

    def _chain_next(self, streams: list[TokenStream], out: dict) -> None:
        """Hand out each stream's pending token and those of every step that has landed (at least one, waited
        for), keeping the last as pending; the chain is topped up before the host's bookkeeping."""
        chain, first = self.chain, self.chain.read
        try:
            steps = [chain.next()]
            while chain.ready():
                steps.append(chain.next())
            chain.fill()
            for s in streams:
                self._hand_out(s, self._fed(chain, s, steps, first), out[id(s)])
        except BaseException:  # the engine failed: the step's streams fail with it, and no chain is left
            self.chain, self.chained, self.joining = None, {}, {}
            raise

    def _drain(self, streams: list[TokenStream], out: dict) -> None:
        """Hand out what the chain's queued steps give to the streams they fed (it queues no more); a stream
        that joined and was fed by none of them has its first token pending, as a prefilled one."""
        chain, chained, first = self.chain, self.chained, self.chain.read
        self.chain, self.chained = None, {}  # gone whatever its last steps do
        chain.stop()
        steps = []
        while (ids := chain.next()) is not None:
            steps.append(ids)
        for s in streams:
            if chained.get(s.slot) is s:
                self._hand_out(s, self._fed(chain, s, steps, first, last=True), out[id(s)])
        self.joining = {}

    def _fed(self, chain, s: TokenStream, steps: list, first: int, last: bool = False) -> list:
        """Of the chain's `steps` (numbered from `first`), those that feed `s`: all, or for a stream that joined
        the chain, those from its join on, its pending token being then its prefill's (`chain.joined`); once
        `last`, that token is taken even where no step fed it."""
        at = self.joining.get(s.slot)
        if at is None:
            return steps
        if at >= first + len(steps) and not last:
            return []
        del self.joining[s.slot]
        s.pending = chain.joined(s.slot)
        return steps[max(0, at - first) :]

    def _join(self, news: list[TokenStream], out: dict) -> bool:
        """Start new streams inside the running greedy chain instead of draining it (`chain.join`: each prompt's
        pass queued between its steps, its first token chosen on the device), when the chain can take every
        one: plain greedy, not speculating, a row of the chain's whose position the chain's remaining steps
        keep inside the context. True when they have joined (those that failed have their error in `out`)."""
        chain, ctx = self.chain, self.cfg.ctx_len
        if not hasattr(chain, "join") or self.stats is not None or chain.width >= ctx:
            return False
        room = chain.steps - chain.queued  # the steps the chain may still queue, each a position further
        if room <= 0 or not all(
            s.sampling.temperature <= 0
            and not _needs_logits(s)
            and s.slot < chain.width
            and len(s.history) + room <= ctx
            for s in news
        ):
            return False
        for s in news:
            failed = _own(s, lambda s=s: self._join_one(s))
            if failed is not None:
                out[id(s)] = failed
        return True

    def _join_one(self, s: TokenStream) -> None:
        reused = self.prefixes.reuse(s.slot, s.history) if self.prefixes else 0
        self.joining[s.slot] = self.chain.join(s.slot, s.history, reused)
        if self.prefixes:
            self.prefixes.keep(s.slot, s.history, reused)
        self.chained[s.slot] = s
        s.pending, s.pos, s.drafts = JOINED, len(s.history), None

    @staticmethod
    def _hand_out(s: TokenStream, steps: list, got: list) -> None:
        """For each step's ids: hand out the pending token (fed at s.pos by that step), whose successor is then
        pending; nothing once the stream is done (its row may have run on)."""
        for ids in steps:
            if s.done:
                return
            t = s.record(s.pending)
            got.append(t)
            s.history.append(t)
            s.pending, s.pos = int(ids[s.slot]), s.pos + 1

    def _verify(self, group: list[TokenStream], out: dict) -> None:
        """One speculative pass of every stream in `group`: its block [pending, drafts...] fed at its position;
        the drafts head 0 agrees with are handed out now (after the token this step gave), the token after the
        last of them is the next pending one, and the draft heads there its next drafts."""
        K = self.cfg.mtp_heads
        blocks = np.array([[s.pending] + s.drafts for s in group], dtype=np.int64)
        ids = self.be.verify_argmax_many([s.slot for s in group], blocks, [s.pos for s in group])  # (n, K, K)
        for s, block, got in zip(group, blocks, ids):
            a = greedy_kept(got, block)
            self.stats.count_pass(a, K)
            s.pending, s.drafts, s.pos = int(got[0, a]), [int(i) for i in got[1:, a]], s.pos + a + 1
            for d in block[1 : a + 1]:
                if s.done:  # a stop id or the last token among the kept drafts
                    break
                out[id(s)].append(s.record(int(d)))
                s.history.append(int(d))

    def _rows(self, feed: list[TokenStream]):
        """The (tokens, positions, fed) of a decode over the slots 0..B-1 only: B the power of two (at most n)
        that holds every fed slot, since an engine may compute every row it is given (a GPU step of 64 rows
        costs several times one of 1, and streams hold the lowest slots). So every fed slot carries its true
        (token, position), where it writes what it will write when fed, and every other row the last
        position, which a slot writes before it reads."""
        self.tokens[:], self.pos[:] = 0, self.cfg.ctx_len - 1  # rows not fed: a position no slot has read yet
        for s in feed:
            self.tokens[s.slot], self.pos[s.slot] = s.pending, s.pos
        B = plan.decode_width(max(s.slot for s in feed) + 1, self.n)  # powers of two: few shapes (graphs)
        fed = np.zeros(B, dtype=bool)
        fed[[s.slot for s in feed]] = True
        return self.tokens[:B].copy(), np.minimum(self.pos[:B], self.cfg.ctx_len - 1), fed

    def _decode(self, feed: list[TokenStream], group: list[TokenStream]) -> None:
        """One decode call for `group` over the rows of `feed` (`_rows`)."""
        tokens, pos, _ = self._rows(feed)
        mask = np.zeros(len(tokens), dtype=bool)
        mask[[s.slot for s in group]] = True
        if _needs_logits(group[0]):  # rows come back in slot order
            group = sorted(group, key=lambda s: s.slot)
            nxt = dict(zip((s.slot for s in group), self._choose(group, self.be.decode_logits(tokens, pos, mask))))
        else:
            nxt = self.be.decode(tokens, pos, group[0].sampling, self.decodes, self.rngs, mask)
        self.decodes += 1
        for s in group:  # (a speculating stream stepped plainly near the context's end has no drafts until a refill)
            s.pending, s.pos, s.drafts = int(nxt[s.slot]), s.pos + 1, None


class _Stepwise:
    """`greedy_chain` for an engine without one (the CPU's): each `next()` is one greedy `decode` of the fed
    rows, whose ids it feeds to the next; nothing runs ahead, so nothing is ever `ready` before it is asked."""

    GREEDY = Sampling(temperature=0)

    def __init__(self, be, tokens, pos, steps: int, fed, rngs):
        self.be, self.tokens, self.pos, self.steps, self.fed, self.rngs = be, tokens, pos, steps, fed, rngs
        self.read = 0
        self.width = len(tokens)
        self.firsts: dict[int, int] = {}  # slot -> the first id of a stream that joined there

    @property
    def queued(self) -> int:
        return self.read

    def join(self, slot: int, ids, start: int) -> int:
        """`greedy_chain`'s join: the prefill now, its greedy id fed to row `slot` from the next step on."""
        logits = _prefill_from(self.be, slot, ids, start)
        self.firsts[slot] = int(np.argmax(to_numpy(logits[0])))
        self.tokens[slot], self.pos[slot], self.fed[slot] = self.firsts[slot], len(ids), True
        return self.read

    def joined(self, slot: int) -> int:
        return self.firsts.pop(slot)

    def next(self) -> np.ndarray | None:
        if self.read >= self.steps:
            return None
        ids = np.asarray(self.be.decode(self.tokens, self.pos, self.GREEDY, self.read, self.rngs, self.fed))
        self.tokens = np.where(self.fed, ids, self.tokens)
        self.pos = self.pos + self.fed  # `steps` keeps the fed rows inside the context
        self.read += 1
        return ids

    def ready(self) -> bool:
        return False

    def fill(self) -> None:
        pass

    def left(self) -> bool:
        return self.read < self.steps

    def stop(self) -> None:
        self.steps = self.read


def _prefill_from(be, slot: int, ids, start: int) -> np.ndarray:
    """Every head's logits at the prompt's last position, its slot's cache already holding ids[:start] (a
    reused prefix; 0: none, a whole prefill). (K, V)."""
    return be.prefill_from(slot, ids, start) if start else be.prefill(slot, ids)


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
        self.ids: dict[tuple, np.ndarray] = {}  # each entry's ids as an array (compared without Python ints)
        self.hits = self.tokens = 0  # prompts that reused rows, and the rows reused

    def _longest(self, ids: list[int]) -> tuple[tuple | None, int]:
        """The cached prompt sharing the longest prefix with `ids`, and the positions `reuse` would copy."""
        best, n, ids = None, 0, np.asarray(ids)
        for key in self.entries:
            m = _common(self.ids[key], ids)
            if m > n:
                best, n = key, m
        n = min(n, len(ids) - 1)
        return (best, n) if n >= self.min_tokens else (None, 0)

    def reuse(self, slot: int, ids: list[int]) -> int:
        """Copy the longest cached prefix of `ids` into `slot`; the number of positions copied (0: none)."""
        best, n = self._longest(ids)
        if not n:
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
        for old in [k for k in self.entries if len(k) <= len(key) and key[: len(k)] == k]:
            del self.entries[old], self.ids[old]  # a prefix of this prompt: its rows are among these
        self.entries[key] = self.be.read_rows(slot, len(key))
        self.ids[key] = np.asarray(key)
        while len(self.entries) > self.size:
            del self.ids[self.entries.popitem(last=False)[0]]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two arrays of ids.

    >>> _common(np.array([1, 2, 3, 4]), np.array([1, 2, 5]))
    2
    """
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
