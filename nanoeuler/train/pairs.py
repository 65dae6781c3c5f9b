"""Preference pairs as token batches, and their sequence log-probabilities under a model.

A pair {prompt, chosen, rejected} (written by `nanoeuler prefs`) becomes two examples that share the
prompt's tokens: prompt + response + `</s>`. Both are cut to the same context by `fit_pair`, so the
policy and the reference always score the very same tokens. A batch of P pairs is 2P rows, the chosen
examples first, then the rejected ones in the same order (the layout `model.dpo` expects); head 0's
targets mark the response tokens and every other head's targets are -1.

    >>> fit_pair([1, 2, 3], [4, 5, 6, 7], [8, 9], ctx_len=5)   # room for 6 tokens: prompt 3, responses <= 3
    ((1, 2, 3), (4, 5, 6), (8, 9))
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from nanoeuler.data.common import jsonl_objects
from nanoeuler.errors import UserError


FIELDS = ("prompt", "chosen", "rejected")


def read_pairs(path: str | Path) -> list[dict]:
    """The {prompt, chosen, rejected} lines of a prefs JSONL; a malformed line is an error naming it."""
    path = Path(path)
    if not os.path.lexists(path):  # lexists: a symlink loop is named as one by the reader
        raise UserError(f"preference pairs {path} do not exist (run `nanoeuler prefs` first)")
    pairs = []
    for n, rec in jsonl_objects(path, "preference pairs"):
        if not all(isinstance(rec.get(k), str) for k in FIELDS):
            raise UserError(f"{path}:{n}: expected an object with string 'prompt', 'chosen' and 'rejected'")
        pairs.append(rec)
    if not pairs:
        raise UserError(f"preference pairs {path} hold no pair")
    return pairs


def load_chat_model(path) -> tuple[dict, object, dict, object, str]:
    """(params, model config, metadata, tokenizer, checksum) of the chat model a DPO stage starts from."""
    from nanoeuler import checkpoint
    from nanoeuler.tokenizer.bpe import Tokenizer

    params, cfg, meta = checkpoint.load_model(path)
    if not meta.get("tokenizer"):
        raise UserError(f"chat model {path} carries no tokenizer (metadata 'tokenizer')")
    return params, cfg, meta, Tokenizer.from_json(meta["tokenizer"]), checkpoint.read_header(path)[1].get("checksum")


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a preference pairs file, read in bounded pieces."""
    from nanoeuler.files import DATA_JSONL
    from nanoeuler.files import file_sha256 as sha256_of

    return sha256_of(path, "preference pairs", DATA_JSONL)


def fit_pair(prompt, chosen, rejected, ctx_len: int):
    """Cut a pair to ctx_len + 1 tokens per example, the same prompt for both.

    The responses keep their heads, all that fits after the whole prompt but at least ctx_len // 2 tokens
    (a long prompt loses its start, as in `nanoeuler chat`); a truncated response loses its `</s>`."""
    budget = ctx_len + 1
    longest = max(len(chosen), len(rejected))
    room = min(longest, max(budget - len(prompt), ctx_len // 2))
    keep_prompt = min(len(prompt), budget - room)
    return tuple(prompt[len(prompt) - keep_prompt :]), tuple(chosen[:room]), tuple(rejected[:room])


def encode_pairs(pairs: list[dict], tok, ctx_len: int) -> tuple[list[tuple], dict]:
    """Pairs -> [(prompt ids, chosen ids, rejected ids)] fitted to the context, and counts of the cuts."""
    out, counts = [], {"truncated": 0, "prompt_cut": 0}
    for pair in pairs:
        prompt = tok.encode(pair["prompt"])
        c = tok.encode(pair["chosen"]) + [tok.end_id]
        r = tok.encode(pair["rejected"]) + [tok.end_id]
        p2, c2, r2 = fit_pair(prompt, c, r, ctx_len)
        counts["truncated"] += (len(c2), len(r2)) != (len(c), len(r))
        counts["prompt_cut"] += len(p2) < len(prompt)
        out.append((p2, c2, r2))
    return out, counts


def pair_batch(examples: list[tuple], K: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """P fitted pairs -> inputs (2P,T) and targets (2P,T,K): chosen rows first; head 0 marks responses."""
    from nanoeuler.train.sft import sft_batch

    rows = [(list(p) + list(c), len(p)) for p, c, _ in examples] + [(list(p) + list(r), len(p)) for p, _, r in examples]
    inputs, targets = sft_batch(rows, K, pad_id)
    targets[:, :, 1:] = -1  # DPO scores head 0 only
    return inputs, targets


def pair_pieces(x, y, ref, pairs: int) -> list[tuple]:
    """A batch of P pairs (2P rows, chosen first; reference log-probs (2P,) alike) cut into pieces of at most
    `pairs` pairs, each laid out as a batch of its own: [(x, y, ref), ...].

        >>> x = np.arange(6)[:, None]                 # chosen rows 0 1 2, rejected rows 3 4 5
        >>> [p[0][:, 0].tolist() for p in pair_pieces(x, x, np.arange(6.0), 2)]
        [[0, 1, 3, 4], [2, 5]]
    """
    P = x.shape[0] // 2
    out = []
    for i in range(0, P, pairs):
        rows = np.r_[i : min(i + pairs, P), P + i : P + min(i + pairs, P)]
        out.append((x[rows], y[rows], np.asarray(ref)[rows]))
    return out


def sequence_logps(params, cfg, examples: list[tuple], batch_size: int, pad_id: int, xp) -> np.ndarray:
    """Summed response log-probabilities (N, 2): column 0 chosen, 1 rejected, in float64 on the host;
    `batch_size` pairs a forward (sized by a stage on the GPU to its memory, `memory.eval_items_for`)."""
    from nanoeuler.backend import to_numpy
    from nanoeuler.memory import score_chunk_rows
    from nanoeuler.model import dpo, transformer

    out = np.zeros((len(examples), 2))
    w = params[transformer.head_weight_names(cfg)[0]]
    for lo in range(0, len(examples), batch_size):
        part = examples[lo : lo + batch_size]
        x, y = pair_batch(part, cfg.mtp_heads, pad_id)
        xn = transformer.final_state(params, xp.asarray(x), cfg)  # (2P,T,C)
        idx, tgt, seq = dpo.response_rows(xp.asarray(y))
        tok = dpo.target_logps(xn.reshape(-1, cfg.dim)[idx], w, tgt, score_chunk_rows(cfg))
        logp = to_numpy(dpo.sequence_logps(tok, seq, 2 * len(part))).astype(np.float64)
        out[lo : lo + len(part)] = logp.reshape(2, len(part)).T
    return out


def split_pairs(n: int, n_val: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices), both sorted; the held-out ones drawn by `seed`."""
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])
