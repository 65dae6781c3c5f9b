"""Self-speculative decoding of one prompt that reports log-probabilities and follows a grammar.

`DecodeEngine.stream(..., speculative=True)` drafts with the MTP heads and verifies the drafts in one pass; this is
the same rule (`accept_or_resample`) with two additions, for callers that need them:

- `top`: each emitted token comes with its log-probability under the target distribution (head 0's
  log-softmax at the row before it, `logprobs.token_logprobs`) and its `top` best alternatives;
- `guide`: a grammar (`allowed()`, `consume(id)`, `stopped`; `serve.structured.Guide`). The target is head
  0's distribution masked to the tokens the grammar allows after everything before the row; drafts are
  drawn unmasked, so a draft the grammar refuses has target probability 0 and is always rejected, and
  the token drawn in its place comes from the masked residual. Each token's distribution is therefore
  exactly that of plain masked sampling; greedily, the output is token for token the plain masked argmax.

Every verify pass keeps the logits (the greedy argmax-only fast paths are not taken).

    >>> for token, logprob, alts in speculative_logprobs(engine, ids, 32, Sampling(temperature=0), top=2):
    ...     print(token, logprob)                                                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from nanoeuler.backend import to_numpy
from nanoeuler.infer.logprobs import token_logprobs
from nanoeuler.infer.sampling import Sampling, accept_or_resample, sample_token, sampling_probs


def speculative_logprobs(
    engine, prompt, max_new_tokens: int, sampling: Sampling, stop_ids=frozenset(), top: int = 0, guide=None
) -> Iterator[tuple[int, float, list[tuple[int, float]]]]:
    """Yield (id, log-probability, [(alternative id, log-probability)...]) per new token; a stop id or the
    grammar's end ends the stream (the stop id is yielded)."""
    be, cfg, st = engine.backend, engine.cfg, engine.stats
    K, ctx = cfg.mtp_heads, cfg.ctx_len
    if max_new_tokens <= 0:
        return
    st.for_heads(K)
    rng = np.random.default_rng(sampling.seed)
    hist = engine._check_prompt(prompt)
    be.start(1, [sampling.seed])

    def choose(row) -> tuple[int, float, list]:
        """A token from head 0's row, masked by the grammar, with its log-probabilities; the grammar takes it."""
        t = sample_token(_masked(row, guide), rng, sampling.temperature, sampling.top_k, sampling.top_p)
        return _taken(row, t, top, guide)

    def drafts_from(heads) -> tuple[list[int], list | None]:
        if sampling.temperature <= 0:
            return [int(np.argmax(to_numpy(z))) for z in heads], None
        qs = [sampling_probs(z, sampling.temperature, sampling.top_k, sampling.top_p) for z in heads]
        return [int(rng.choice(q.shape[0], p=q)) for q in qs], qs

    heads = be.prefill(0, hist)  # (K, V)
    sure = choose(heads[0])
    drafts, qs = drafts_from(heads[1:])
    n = 0
    while True:
        yield sure
        n += 1
        hist.append(sure[0])
        if sure[0] in stop_ids or n == max_new_tokens or (guide is not None and guide.stopped):
            return
        pos = len(hist) - 1  # where `sure` will be fed
        if pos >= ctx or pos + K > ctx or K == 1:  # no room for a block: one row (after a refill when full)
            if pos >= ctx:
                hist = hist[-max(1, ctx // 2) :]
                heads = be.prefill(0, hist)
            else:
                heads = be.verify(np.array([sure[0]]), pos)[:, 0]
            sure = choose(heads[0])
            drafts, qs = drafts_from(heads[1:])
            continue
        block = [sure[0]] + drafts
        logits = be.verify(np.array(block), pos)  # (K, K, V): head, row
        kept, nxt = [], None
        for j in range(K - 1):
            x = block[j + 1]
            if sampling.temperature <= 0:
                best = int(np.argmax(_masked(logits[0, j], guide)))
                ok, t = best == x, best
            else:
                p = sampling_probs(_masked(logits[0, j], guide), sampling.temperature, sampling.top_k, sampling.top_p)
                ok, t = accept_or_resample(p, qs[j], x, rng.random(), rng)
            if not ok:
                nxt = _taken(logits[0, j], t, top, guide)
                break
            kept.append(_taken(logits[0, j], x, top, guide))
        a = len(kept)
        if nxt is None:
            nxt = choose(logits[0, K - 1])
        st.count_pass(a, K)
        drafts, qs = drafts_from(logits[1:, a])
        for token in kept:
            yield token
            n += 1
            hist.append(token[0])
            if token[0] in stop_ids or n == max_new_tokens or (guide is not None and guide.stopped):
                return
        sure = nxt


def _masked(row, guide):
    """Head 0's row with the tokens the grammar refuses at -inf (float64 on the host); the row itself without one."""
    if guide is None:
        return row
    allowed = guide.allowed()
    if not allowed.any():
        raise RuntimeError("the grammar allows no token here")
    return np.where(allowed, np.asarray(to_numpy(row), dtype=np.float64), -np.inf)


def _taken(row, token: int, top: int, guide) -> tuple[int, float, list]:
    """(token, its log-probability, alternatives) under the unmasked row; the grammar consumes the token."""
    if guide is not None:
        guide.consume(token)
    lp, alts = token_logprobs(row[None], [token], top)[0]
    return int(token), lp, alts
