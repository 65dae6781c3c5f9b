"""Launchers of sampling.cu: the next token of each row on the GPU, a block of SAMPLE_THREADS a row.
ctl = [ids, slots, positions (M each), top_k, step, temperature bits, top_p bits] (int32), as the
backend's row buffers hold it."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels.decode.plan import SAMPLE_THREADS

i32, i64 = np.int32, np.int64


def argmax_rows(go, logits, V: int, stride: int, out, rows: int) -> None:
    """out[r] = argmax of logits row r (V wide, rows `stride` apart); the lowest index wins a tie."""
    go.launch("argmax_rows", (rows,), (SAMPLE_THREADS,), (logits, i32(V), i64(stride), out))


def argmax_chain(go, logits, V: int, out, ctl, hist, cap: int, L: int, arrive, M: int) -> None:
    """argmax_rows of M rows (V apart) that feeds the next step: each row's id becomes its next input at
    the next position (kept below L), recorded in the ring hist of `cap` steps (pinned host memory)."""
    go.launch("argmax_chain", (M,), (SAMPLE_THREADS,), (logits, i32(V), out, ctl, hist, i32(cap), i32(L), arrive))


def accept_chain(go, out, ctl, hist, cap: int, K: int) -> None:
    """After a verify pass of one slot's K rows with every head's argmax in out (K rows, K heads): keep the
    drafts that head 0 confirms, record the pass in hist, and write the next pass's block into ctl."""
    go.launch("accept_chain", (1,), (32,), (out, ctl, hist, i32(cap), i32(K)))


def sample_rows(go, logits, V: int, stride: int, samp, seeds, out, rows: int) -> None:
    """out[r] = a token drawn from row r's logits as generate.sampling_probs (samp: top_k, counter,
    temperature and top_p bits), by the counter-based generator at (seeds[r], counter)."""
    go.launch("sample_rows", (rows,), (SAMPLE_THREADS,), (logits, i32(V), i64(stride), samp, seeds, out))
