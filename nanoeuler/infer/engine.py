"""The decode engine: batched, cached, optionally self-speculative generation behind one interface.

    >>> eng = DecodeEngine.from_params(params, cfg, device="cpu")                # doctest: +SKIP
    >>> eng.generate([[5, 17, 42], [8]], 32, Sampling(temperature=0))          # doctest: +SKIP
    [[...32 ids...], [...32 ids...]]
    >>> for t in eng.stream([5, 17, 42], 32, Sampling(), speculative=True):    # doctest: +SKIP
    ...     print(t)
    >>> eng, tok, meta = load("results/chat.bin", device="auto")               # doctest: +SKIP

This module holds the host-side logic, written once: the context policy, stop ids, the batched loop over
ragged prompts, and self-speculative decoding. The arithmetic lives in a backend with four calls
(`cpu.CpuBackend` on NumPy, `gpu.GpuBackend` with bf16 weights and CUDA graphs):

    start(batch, seeds)                 make `batch` empty cache slots; seeds of their samplers
    prefill(slot, ids) -> (K, V)        fill slot's cache with ids; every head's logits at the last one
    prefill_many(slots, prompts, starts) the same for several slots at once -> (len(slots), K, V); with
                                        `starts`, each slot's cache already holds its first rows
    decode(tokens, pos, sampling, step) feed one token per slot at its position; the next token per slot
    verify(tokens, pos) -> (K, t, V)    feed t tokens of slot 0 at pos..pos+t-1; every head's logits
    verify_argmax(tokens, pos) -> (K,t) the same, reduced to argmax ids (the greedy fast path)

and `verify_cost`, a verify pass's time in decode steps; and optionally (the GPU's) greedy steps and
speculative passes that feed themselves on the device, queued ahead of the host: `greedy_chain(tokens,
pos, steps)` (the server reads it step by step), `greedy_steps(tokens, pos, n)` (its steps as a generator)
and `greedy_passes(sure, drafts, pos)`.

Positions are the host's: a slot's cache holds whatever was fed at positions < pos, so rewinding after
rejected drafts costs nothing (the next feed overwrites them; attention never looks past the row's own
position).

Context policy: the same as `generate.Generator` (the reference): when a slot's cache is full, it is
refilled from the most recent `ctx_len // 2` tokens and generation goes on.

Self-speculative decoding. Head 0 predicts token t+1 and head k predicts t+1+k from the same hidden
state, so one forward gives a sure next token and K-1 drafts after it (a `Proposal`). A verify pass feeds
[sure, draft_1, ..., draft_{K-1}] at once; head 0 at row j is the model's own prediction after row j.
Greedy (`greedy_verify`, `greedy_kept`): draft j is kept while it equals the argmax at row j-1; the argmax
after the last kept row is the next sure token, so the output is token for token the plain greedy one.
Sampling (`sampled_verify`, `sampled_kept`): draft x drawn from the draft head's distribution q is kept
with probability min(1, p(x)/q(x)), p being head 0's distribution at the row before it; at the first
rejection the next token is drawn from max(0, p - q) renormalised (and after K-1 acceptances from head
0's last row), which makes each token's distribution exactly plain sampling's (`accept_or_resample`).

A pass pays when it keeps more tokens than it costs decode steps (the backend's `verify_cost`, measured:
BENCHMARKS.md). Where speculation is on by default rather than asked for, a greedy stream decides as it
goes, the same tokens either way:

- on a backend with self-feeding passes (the GPU's), a stream whose first PROBE_PASSES passes keep fewer
  tokens a pass than `verify_cost` goes on plainly;
- on a backend with `greedy_step` (the CPU's), a stream starts plainly and speculates only where this run's
  own measurements say a pass pays (`_adaptive`): its plain steps are plain decoding's steps that also
  return their final state, and once the tokens after SHADOW_STEPS of them are known, the draft heads at
  those states (`draft_ids`, one small matrix product) show how many drafts a pass would have kept there.
  It speculates when that estimate, 1 + the mean kept drafts, exceeds the cost of a pass in plain steps
  (this run's measured pass time over its measured step time; `verify_cost` before a pass was timed). It
  goes back to plain steps when the first pass's measured cost prices the estimate out, or when a window of
  WINDOW_PASSES passes kept fewer tokens a pass than the measured cost; after RECHECK_TOKENS plain tokens
  it looks again. Untrained heads thus cost one product of SHADOW_STEPS + 1 rows every RECHECK_TOKENS
  tokens, never a verify pass.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from nanoeuler.infer.sampling import Sampling, accept_or_resample, sample_token, sampling_probs

PROBE_PASSES = 16  # verify passes before a default-on greedy stream checks that speculation pays (GPU)
SHADOW_STEPS = 8  # plain steps whose draft heads are checked before a stream judges speculation (CPU)
WINDOW_PASSES = 8  # verify passes between two judgements of a speculating stream (CPU)
RECHECK_TOKENS = 128  # plain tokens before a stream that judged speculation not to pay looks again (CPU)


@dataclass
class SpecStats:
    """Counters of self-speculative decoding: passes, tokens, and per-draft-head acceptances."""

    passes: int = 0
    tokens: int = 0
    offered: list[int] = field(default_factory=list)  # drafts of head k+1 that were checked
    accepted: list[int] = field(default_factory=list)
    plain: int = 0  # tokens of speculative streams that came from plain steps (the adaptive rule's)

    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    def acceptance(self) -> list[float]:
        return [a / o if o else 0.0 for a, o in zip(self.accepted, self.offered)]

    def for_heads(self, K: int) -> None:
        """Per-draft-head counters for a model of K heads (kept across streams of the same model)."""
        if len(self.offered) != K - 1:
            self.offered, self.accepted = [0] * (K - 1), [0] * (K - 1)

    def count_pass(self, a: int, K: int) -> None:
        """A verify pass that kept `a` of its K - 1 drafts (and emitted a + 1 tokens)."""
        self.passes += 1
        self.tokens += a + 1
        for j in range(K - 1):  # draft j is checked when all before it were kept
            self.offered[j] += j <= a
            self.accepted[j] += j < a


# ---- the verify rules of self-speculative decoding ------------------------------------------------------


def greedy_kept(ids: np.ndarray, block: np.ndarray) -> int:
    """The drafts a greedy verify pass keeps: block (K,) is the sure token and K - 1 drafts, ids (K, K) each
    head's argmax by row; draft a + 1 stands while head 0's argmax at row a equals it.

        >>> greedy_kept(np.array([[5, 6, 9], [0, 0, 0], [0, 0, 0]]), np.array([4, 5, 6]))
        2
    """
    a = 0
    while a < len(block) - 1 and ids[0, a] == block[a + 1]:
        a += 1
    return a


class Proposal(NamedTuple):
    """What one row of every head proposes: the next token (head 0's), the drafts after it (heads 1..),
    and the distributions the drafts were drawn from (None when greedy)."""

    sure: int
    drafts: list[int]
    qs: list[np.ndarray] | None


def draft_tokens(logits, rng, sampling: Sampling) -> tuple[list[int], list[np.ndarray] | None]:
    """(drafts, their distributions) from the draft heads' logits (K - 1, V): argmaxes when greedy, else
    draws from each head's `sampling_probs`."""
    if sampling.temperature <= 0:
        return [int(np.argmax(z)) for z in logits], None
    qs = [sampling_probs(z, sampling.temperature, sampling.top_k, sampling.top_p) for z in logits]
    return [int(rng.choice(q.shape[0], p=q)) for q in qs], qs


def propose(heads, rng, sampling: Sampling) -> Proposal:
    """The `Proposal` of one row's logits, every head's (K, V): head 0 sampled as plain decoding samples."""
    sure = sample_token(heads[0], rng, sampling.temperature, sampling.top_k, sampling.top_p)
    return Proposal(sure, *draft_tokens(heads[1:], rng, sampling))


def greedy_verify(be, block: np.ndarray, pos: int) -> tuple[int, Proposal]:
    """A greedy verify pass of block (the sure token and K - 1 drafts) fed at pos: (drafts kept, the
    proposal of the row after the last kept one)."""
    ids = be.verify_argmax(block, pos)  # (K, K): head, row
    a = greedy_kept(ids, block)
    return a, Proposal(int(ids[0, a]), [int(i) for i in ids[1:, a]], None)


def sampled_kept(target, block: np.ndarray, qs, rng, sampling: Sampling) -> tuple[int, int]:
    """Speculative sampling over one pass: (drafts kept, the token after them). target: head 0's logits
    (K, V) by row; draft j + 1 stands or falls by `accept_or_resample` against row j, and when all stand
    the token after them is drawn from the last row.

        >>> target = np.log([[1.0, 1e-12], [1e-12, 1.0], [0.5, 0.5]])   # head 0's logits by row
        >>> q = np.array([1.0, 0.0])                                       # both drafts: token 0, for certain
        >>> sampled_kept(target, np.array([7, 0, 0]), [q, q], np.random.default_rng(0), Sampling(1.0, 0, 1.0))
        (1, 1)
    """
    K = len(block)
    for j in range(K - 1):
        p = sampling_probs(target[j], sampling.temperature, sampling.top_k, sampling.top_p)
        ok, tok = accept_or_resample(p, qs[j], int(block[j + 1]), rng.random(), rng)
        if not ok:
            return j, tok
    return K - 1, sample_token(target[K - 1], rng, sampling.temperature, sampling.top_k, sampling.top_p)


def sampled_verify(be, block: np.ndarray, pos: int, qs, rng, sampling: Sampling) -> tuple[int, Proposal]:
    """A sampled verify pass of block fed at pos (qs: the drafts' distributions): (drafts kept, the
    proposal of the row after the last kept one, whose drafts come from the same pass)."""
    logits = be.verify(block, pos)  # (K, K, V): head, row
    a, nxt = sampled_kept(logits[0], block, qs, rng, sampling)
    return a, Proposal(nxt, *draft_tokens(logits[1:, a], rng, sampling))


class _Passes:
    """The verify passes of one speculative stream: the backend's greedy passes that feed themselves where it
    has them (the GPU's, queued ahead of the host), else `greedy_verify` or `sampled_verify`, one a pass."""

    def __init__(self, be, sampling: Sampling, rng):
        self.be, self.sampling, self.rng = be, sampling, rng
        self.chain = getattr(be, "greedy_passes", None) if sampling.temperature <= 0 else None
        self.ahead = None  # the chain's passes, while it runs
        self.count = self.tokens = 0  # this stream's passes and the tokens they gave

    def verify(self, cur: Proposal, pos: int) -> tuple[int, np.ndarray, Proposal]:
        """One pass over cur's sure token and drafts fed at pos: (drafts kept, the block, the next proposal)."""
        got = self._fed(cur, pos)
        if got is not None:
            a, block, nxt = got
        else:
            block = np.array([cur.sure] + cur.drafts)
            a, nxt = (
                greedy_verify(self.be, block, pos)
                if self.sampling.temperature <= 0
                else sampled_verify(self.be, block, pos, cur.qs, self.rng, self.sampling)
            )
        self.count += 1
        self.tokens += a + 1
        return a, block, nxt

    def _fed(self, cur: Proposal, pos: int):
        """The chain's next pass as (kept, block, proposal), or None where there is no chain or it has ended."""
        if self.chain is None:
            return None
        self.ahead = self.ahead or self.chain(cur.sure, cur.drafts, pos)
        got = next(self.ahead, None)
        if got is None:
            self.ahead = None
            return None
        a, block, ids = got
        return a, block, Proposal(int(ids[0]), [int(i) for i in ids[1:]], None)

    def drop(self) -> None:
        """Forget the chain's queued passes (they only wrote cache rows that later feeds overwrite)."""
        self.ahead = None

    def unpaid(self) -> bool:
        """After PROBE_PASSES passes: did they keep fewer tokens a pass than a pass costs in plain steps?"""
        return self.count == PROBE_PASSES and self.tokens < self.be.verify_cost * self.count


class _Tally:
    """A stream's emitted tokens: the history its cache holds and how many it has emitted."""

    def __init__(self, hist: list[int], max_new: int, stop_ids):
        self.hist, self.max_new, self.stop_ids, self.n = hist, max_new, stop_ids, 0

    def ends(self, t: int) -> bool:
        """Take emitted token t; True when it ends the stream (a stop id, or the last of max_new)."""
        self.n += 1
        self.hist.append(t)
        return t in self.stop_ids or self.n == self.max_new

    def refill(self, ctx: int) -> list[int]:
        """Keep the most recent ctx // 2 tokens (the cache is full and is refilled from them)."""
        self.hist = self.hist[-max(1, ctx // 2) :]
        return self.hist


# ---- the engine ----------------------------------------------------------------------------------------


class DecodeEngine:
    """Generation on one backend for one model (see the module docstring)."""

    def __init__(self, backend, cfg, params: dict | None = None, xp=np, speculative: bool | None = None):
        self.backend = backend
        self.cfg = cfg
        self.params = params  # the float32 weights it was made from (on `xp`), for evaluation code
        self.xp = xp
        self.speculative = speculative  # the default of `stream` and `generate`; None: `_use_speculation`
        self.stats = SpecStats()
        # rows decoded at once at most (None: no cap), and the memory budget it came from (`load`)
        self.max_batch: int | None = None
        self.budget = self.meter = None

    @classmethod
    def from_params(
        cls,
        params: dict,
        cfg,
        device: str = "cpu",
        dtype: str = "bf16",
        speculative: bool | None = None,
        threads: int | None = None,
    ) -> "DecodeEngine":
        """An engine for NumPy/CuPy `params`: NumPy on 'cpu' (the params' own float dtype; `threads` for BLAS,
        default the usable cores: `cpu.CpuBackend`), CUDA kernels on 'gpu' (`dtype` 'bf16' or
        'fp32' weights)."""
        if device == "gpu":
            import cupy

            from nanoeuler.infer.gpu import GpuBackend

            return cls(
                GpuBackend(params, cfg, dtype=dtype),
                cfg,
                {k: cupy.asarray(v) for k, v in params.items()},
                cupy,
                speculative,
            )
        from nanoeuler.backend import to_numpy
        from nanoeuler.infer.cpu import CpuBackend

        params = {k: to_numpy(v) for k, v in params.items()}
        return cls(CpuBackend(params, cfg, threads), cfg, params, np, speculative)

    # ---- batch: many prompts at once, plain decoding -----------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: Sampling,
        stop_ids=frozenset(),
        speculative: bool | None = None,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[list[int]]:
        """New ids for each prompt (a stop id ends a row and is included). Prompt i samples with seed
        sampling.seed + i. `on_token(row, id)` is called as each id is chosen. With `speculative`, the
        prompts run one after the other through `stream(..., speculative=True)` (default: `self.speculative`).
        More prompts than `max_batch` run in groups of that many (prompt i still samples with seed + i)."""
        if self.max_batch and len(prompts) > self.max_batch:
            return self._grouped(prompts, max_new_tokens, sampling, stop_ids, speculative, on_token)
        if self._use_speculation(speculative, sampling, len(prompts)):
            out = []
            for i, p in enumerate(prompts):
                s = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed + i)
                row = []
                for t in self.stream(p, max_new_tokens, s, stop_ids, speculative=speculative or self.speculative):
                    row.append(t)
                    if on_token:
                        on_token(i, t)
                out.append(row)
            return out
        out: list[list[int]] = [[] for _ in prompts]
        events = (
            ((0, t) for t in self._single(prompts[0], max_new_tokens, sampling, stop_ids))
            if len(prompts) == 1
            else self._batch(prompts, max_new_tokens, sampling, stop_ids)
        )
        for b, t in events:
            out[b].append(t)
            if on_token:
                on_token(b, t)
        return out

    def report_memory(self, stage: str, rows: int) -> None:
        """Log the measured and predicted device peak of a stage that decoded `rows` rows at once (GPU only)."""
        if self.budget is not None:
            from nanoeuler import memory

            self.meter.report(
                stage,
                memory.peak(memory.decode_parts(self.cfg, rows), self.budget.context),
                detail=f"{rows} rows decoded at once",
            )

    def _grouped(self, prompts, max_new, sampling, stop_ids, speculative, on_token) -> list[list[int]]:
        """`generate` over groups of `max_batch` prompts: the KV cache of that many rows fits the memory."""
        out: list[list[int]] = []
        for lo in range(0, len(prompts), self.max_batch):
            part = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed + lo)
            shifted = None if on_token is None else (lambda b, t, lo=lo: on_token(lo + b, t))
            out += self.generate(prompts[lo : lo + self.max_batch], max_new, part, stop_ids, speculative, shifted)
        return out

    def _use_speculation(self, asked: bool | None, sampling: Sampling, rows: int) -> bool:
        """The call's choice, else the engine's; where neither chose: on for greedy decoding of one prompt,
        where it was measured faster on both backends, off for sampling (slower: fewer drafts are kept)
        and for batches (one batched pass beats prompts one after the other). BENCHMARKS.md has the figures."""
        choice = self.speculative if asked is None else asked
        if choice is None:
            return sampling.temperature <= 0 and rows == 1
        return choice

    def _batch(self, prompts, max_new, sampling, stop_ids) -> Iterator[tuple[int, int]]:
        """(row, id) events of plain decoding of all prompts at once, one decode step per round. Greedy
        decoding on a backend with `greedy_steps` takes the ids from there while no slot is refilled."""
        B, ctx, be = len(prompts), self.cfg.ctx_len, self.backend
        if max_new <= 0 or B == 0:
            return
        hist = [self._check_prompt(p) for p in prompts]
        rngs = [np.random.default_rng(sampling.seed + i) for i in range(B)]
        be.start(B, [sampling.seed + i for i in range(B)])
        first = be.prefill_many(list(range(B)), hist)  # (B, K, V)
        pending = np.array([self._first(first[b, 0], rngs[b], sampling) for b in range(B)])
        pos = np.array([len(h) for h in hist])  # where each slot's pending token will be fed
        count = np.zeros(B, dtype=np.int64)
        live = np.ones(B, dtype=bool)
        step = 0
        chain = getattr(be, "greedy_steps", None) if sampling.temperature <= 0 else None
        ahead = None  # greedy_steps' ids, while every live row is fed each round
        while True:
            feed = np.zeros(B, dtype=bool)
            for b in np.flatnonzero(live):
                t = int(pending[b])
                count[b] += 1
                hist[b].append(t)
                yield int(b), t
                if t in stop_ids or count[b] == max_new:
                    live[b] = False
                elif pos[b] >= ctx:  # this slot's cache is full: refill it from its recent tokens
                    hist[b] = hist[b][-max(1, ctx // 2) :]
                    pending[b] = self._first(be.prefill(int(b), hist[b])[0], rngs[b], sampling)
                    pos[b] = len(hist[b])
                else:
                    feed[b] = True
            if not live.any():
                return
            if not feed.any():
                continue
            nxt = None
            if chain is not None and (feed == live).all():  # no slot was refilled: steps that feed themselves
                if ahead is None:  # up to the first live row's end of context, or the last one's last token
                    ahead = chain(
                        pending,
                        np.minimum(pos, ctx - 1),
                        int(min((ctx - pos[live]).min(), (max_new - count[live]).max())),
                    )
                nxt = next(ahead, None)
            if nxt is None:
                ahead = None
                nxt = be.decode(pending, np.minimum(pos, ctx - 1), sampling, step, rngs, feed)
            pending = np.where(feed, nxt, pending)
            pos = np.where(feed, pos + 1, pos)
            step += 1

    # ---- one prompt, streamed ---------------------------------------------------------------------

    def stream(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop_ids=frozenset(),
        speculative: bool | None = None,
    ) -> Iterator[int]:
        """Yield new ids one at a time; a stop id is yielded and ends the stream. `speculative`: draft with
        the MTP heads (default: `self.speculative`)."""
        if max_new_tokens <= 0:
            return
        if not self._use_speculation(speculative, sampling, 1):
            yield from self._single(prompt, max_new_tokens, sampling, stop_ids)
            return
        asked = speculative if speculative is not None else self.speculative
        be = self.backend
        if (
            asked is None
            and sampling.temperature <= 0
            and hasattr(be, "greedy_step")
            and not hasattr(be, "greedy_passes")
        ):
            yield from self._adaptive(prompt, max_new_tokens, sampling, stop_ids)
            return
        yield from self._speculative(prompt, max_new_tokens, sampling, stop_ids, probe=asked is None)

    def _single(self, prompt, max_new, sampling, stop_ids) -> Iterator[int]:
        """Plain decoding of one prompt: `_batch` with one row, in plain ints (the host's share of a step
        is a few microseconds of Python, not NumPy calls)."""
        if max_new <= 0:
            return
        hist = self._check_prompt(prompt)
        rng = np.random.default_rng(sampling.seed)
        self.backend.start(1, [sampling.seed])
        tok = self._first(self.backend.prefill(0, hist)[0], rng, sampling)
        yield from self._plain(hist, tok, 0, max_new, sampling, stop_ids, rng)

    def _plain(self, hist, tok, n, max_new, sampling, stop_ids, rng) -> Iterator[int]:
        """Plain decoding of slot 0 from `tok` (not yet yielded; the cache holds hist's positions, n ids
        were yielded before). Greedy decoding on a backend with `greedy_steps` (the GPU's: steps that
        feed themselves, queued ahead) takes its ids from there."""
        be, ctx = self.backend, self.cfg.ctx_len
        rngs = [rng]
        feed, pos = [0], [len(hist)]
        mask = np.ones(1, dtype=bool)
        chain = getattr(be, "greedy_steps", None) if sampling.temperature <= 0 else None
        ahead = None  # greedy_steps' ids, up to the end of the context or of max_new
        while True:
            yield tok
            n += 1
            hist.append(tok)
            if tok in stop_ids or n == max_new:
                return
            if pos[0] >= ctx:  # the cache is full: refill it from the recent tokens
                hist = hist[-max(1, ctx // 2) :]
                tok = self._first(be.prefill(0, hist)[0], rngs[0], sampling)
                pos[0] = len(hist)
                ahead = None
                continue
            if chain is not None:
                if ahead is None:
                    ahead = chain([tok], pos, min(max_new - n, ctx - pos[0]))
                tok = int(next(ahead)[0])
            else:
                feed[0] = tok
                tok = int(be.decode(feed, pos, sampling, n - 1, rngs, mask)[0])
            pos[0] += 1

    def _speculative(self, prompt, max_new, sampling, stop_ids, probe: bool = False):
        """Self-speculative decoding of one prompt: emit the sure token, then refill a full cache, step one row
        near the end of the context, or verify a block (`_Passes`) and emit the drafts it kept. `probe`: a
        greedy stream goes on plainly (`_plain`) once its first PROBE_PASSES passes did not pay."""
        be, K, ctx = self.backend, self.cfg.mtp_heads, self.cfg.ctx_len
        out = _Tally(self._check_prompt(prompt), max_new, stop_ids)
        rng = np.random.default_rng(sampling.seed)
        be.start(1, [sampling.seed])
        self.stats.for_heads(K)
        passes = _Passes(be, sampling, rng)
        cur = propose(be.prefill(0, out.hist), rng, sampling)
        while True:
            yield cur.sure
            if out.ends(cur.sure):
                return
            pos = len(out.hist) - 1  # where the sure token will be fed
            if pos >= ctx:  # the cache is full: refill it from the recent tokens
                cur = propose(be.prefill(0, out.refill(ctx)), rng, sampling)
                passes.drop()
            elif pos + K > ctx or K == 1:  # no room for a block: one row, whose heads still draft
                cur = propose(be.verify(np.array([cur.sure]), pos)[:, 0], rng, sampling)
                passes.drop()
            else:
                a, block, cur = passes.verify(cur, pos)
                self.stats.count_pass(a, K)
                for d in block[1 : a + 1]:
                    yield int(d)
                    if out.ends(int(d)):
                        return
                if probe and sampling.temperature <= 0 and passes.unpaid():
                    passes.drop()
                    yield from self._plain(out.hist, cur.sure, out.n, max_new, sampling, stop_ids, rng)
                    return

    def _adaptive(self, prompt, max_new, sampling, stop_ids) -> Iterator[int]:
        """Greedy decoding of one prompt that speculates only where this run measures that it pays (the
        module docstring's rule for a backend with `greedy_step`; the tokens are plain greedy's)."""
        be, cfg = self.backend, self.cfg
        K, ctx = cfg.mtp_heads, cfg.ctx_len
        if K == 1:  # no draft heads
            yield from self._single(prompt, max_new, sampling, stop_ids)
            return
        out = _Tally(self._check_prompt(prompt), max_new, stop_ids)
        be.start(1, [sampling.seed])
        st = self.stats
        st.for_heads(K)
        cur = propose(be.prefill(0, out.hist), None, sampling)  # greedy: no draws
        spec = False  # verifying drafts, else plain steps
        shadow = []  # (position fed, final state) of plain steps whose drafts will be checked
        plain_left = 0  # plain tokens before the next steps are recorded
        expect = 0.0  # tokens a pass should keep, by the recorded steps' drafts
        t_step = t_pass = None  # this run's seconds per plain step, per verify pass (running means)
        w_passes = w_tokens = 0  # the current window of passes
        while True:
            yield cur.sure
            if out.ends(cur.sure):
                return
            pos = len(out.hist) - 1  # where the sure token will be fed
            if pos >= ctx:  # the cache is full: refill it from the recent tokens
                cur = propose(be.prefill(0, out.refill(ctx)), None, sampling)
                shadow = []
                continue
            if spec and pos + K <= ctx:
                block = np.array([cur.sure] + cur.drafts)
                t0 = time.perf_counter()
                a, cur = greedy_verify(be, block, pos)
                t_pass = _mean(t_pass, time.perf_counter() - t0)
                st.count_pass(a, K)
                w_passes, w_tokens = w_passes + 1, w_tokens + a + 1
                for d in block[1 : a + 1]:
                    yield int(d)
                    if out.ends(int(d)):
                        return
                # back to plain steps when the first pass's measured cost prices the estimate out, or when a
                # window of passes kept fewer tokens than they cost
                cost = _cost(be, t_pass, t_step)
                if (w_passes == 1 and expect <= cost) or (w_passes == WINDOW_PASSES and w_tokens < w_passes * cost):
                    spec, plain_left = False, RECHECK_TOKENS
                if w_passes == WINDOW_PASSES:
                    w_passes = w_tokens = 0
                continue
            # a plain step: the very call of plain decoding, plus keeping its state while recording
            st.plain += 1
            t0 = time.perf_counter()
            sure, state = be.greedy_step(cur.sure, pos)
            t_step = _mean(t_step, time.perf_counter() - t0)
            cur = Proposal(sure, cur.drafts, None)
            if spec:  # a plain step near the context's end: the next pass needs its drafts
                cur = Proposal(sure, [int(i) for i in be.draft_ids(state[None])[:, 0]], None)
                continue
            if plain_left > 0:
                plain_left -= 1
                continue
            if len(shadow) < SHADOW_STEPS:
                shadow.append((pos, state))
            # once the tokens after the last recorded step are known (K - 1 steps later), check every
            # record's drafts as a pass would have, all heads of all records in one product
            if len(shadow) == SHADOW_STEPS and len(out.hist) >= shadow[-1][0] + K:
                ids = be.draft_ids(np.stack([x for _, x in shadow] + [state]))  # (K - 1, SHADOW_STEPS + 1)
                known = out.hist + [sure]
                expect = 1 + sum(_kept(known, p, ids[:, i]) for i, (p, _) in enumerate(shadow)) / len(shadow)
                shadow = []
                if expect > _cost(be, t_pass, t_step):
                    spec, w_passes, w_tokens = True, 0, 0
                    cur = Proposal(sure, [int(i) for i in ids[:, -1]], None)  # made at this step: the first pass's
                else:
                    plain_left = RECHECK_TOKENS

    @staticmethod
    def _first(logits, rng, sampling) -> int:
        return sample_token(logits, rng, sampling.temperature, sampling.top_k, sampling.top_p)

    def _check_prompt(self, prompt) -> list[int]:
        if len(prompt) == 0:
            raise ValueError("generation needs at least one prompt token")
        V = self.cfg.vocab_size
        ids = [int(t) for t in prompt][-self.cfg.ctx_len :]
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"prompt holds ids outside [0, {V})")
        return ids


def _mean(old: float | None, new: float) -> float:
    """A running mean that follows the machine's speed as it changes (a shared machine's load)."""
    return new if old is None else 0.75 * old + 0.25 * new


def _cost(be, t_pass: float | None, t_step: float | None) -> float:
    """A verify pass's time in plain steps: this run's measurement, else the backend's figure."""
    return t_pass / t_step if t_pass is not None and t_step else be.verify_cost


def _kept(hist: list[int], pos: int, drafts: list[int]) -> int:
    """How many drafts made at position pos (for pos+2, pos+3, ...) a verify pass would have kept."""
    a = 0
    while a < len(drafts) and pos + 2 + a < len(hist) and hist[pos + 2 + a] == drafts[a]:
        a += 1
    return a


def add_speculative_argument(parser) -> None:
    parser.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="self-speculative decoding: the MTP heads draft, one pass verifies (same greedy "
        "output; same sampling distribution). Default: on for greedy decoding "
        "(--temperature 0) of one prompt where it pays: on a GPU it goes on plainly when "
        "its first 16 passes keep too few drafts; on the CPU it verifies drafts only while "
        "the run measures that passes beat plain steps; off for sampling",
    )


def add_threads_argument(parser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads of the NumPy engine: its prefills use them, its one-row decode steps "
        "use them or one, whichever it measures faster; default: the usable cores",
    )


# ---- an engine from a model file -------------------------------------------------------------------------

DECODE_ROWS_MOST = 256  # generation slots at most, whatever the memory holds


def load(
    path,
    device: str = "auto",
    speculative: bool | None = None,
    gpu_memory="auto",
    stage: str = "sample",
    threads: int | None = None,
    batch_speculation: bool = False,
):
    """(`DecodeEngine` on `device`, Tokenizer, metadata) from a model file that carries its tokenizer.
    On the GPU the engine runs bf16 weights (the float32 ones stay in `engine.params`), and `gpu_memory`
    (the config key) caps the rows it decodes at once (`DecodeEngine.max_batch`, `memory.decode_batch`;
    `batch_speculation`: with a speculating server's verify buffers counted); on the CPU it uses up to
    `threads` BLAS threads (default: the usable cores; `--threads`)."""
    from nanoeuler import checkpoint, memory
    from nanoeuler.backend import resolve_device
    from nanoeuler.errors import UserError
    from nanoeuler.tokenizer.bpe import Tokenizer

    params, cfg, meta = checkpoint.load_model(path)
    if not meta.get("tokenizer"):
        raise UserError(f"{path} carries no tokenizer (metadata 'tokenizer'); use a file written by pretrain or sft")
    try:
        tok = Tokenizer.from_json(meta["tokenizer"])
    except UserError as exc:
        raise UserError(f"{path}: its tokenizer is unreadable: {exc}") from None
    device = resolve_device(device)
    xp = np if device == "cpu" else __import__("cupy")
    meter = memory.PeakMeter(xp)
    budget = memory.Budget.on_device(gpu_memory, xp)  # before this model's weights take their share
    engine = DecodeEngine.from_params(params, cfg, device, speculative=speculative, threads=threads)
    engine.budget, engine.meter = budget, meter
    engine.max_batch = memory.decode_batch(stage, budget, cfg, DECODE_ROWS_MOST, speculative=batch_speculation)
    return engine, tok, meta
