"""`nanoeuler hellaswag-eval`: HellaSwag accuracy of a model, scored completion-style as llm.c does.

Each item is a context and four endings, one of them right. Every ending becomes a row
`ctx tokens + tokens of " " + ending`; the model scores only the ending's tokens:

- `acc`:      the pick is the ending with the largest summed log-probability of its tokens;
- `acc_norm`: the pick is the ending with the largest mean log-probability per token,
              which does not favour short endings.

Chance is 25%; GPT-2 124M scores 28.6% / 29.6% this way in llm.c's `dev/data/hellaswag.py`.
A row longer than the model's context keeps its last `ctx_len + 1` tokens (the context loses
its start); the ending is always scored whole unless it alone is longer than the context.
Items go through the model `batch_size` at a time (4 rows each, right-padded: the model is
causal, so padding after a row changes none of its log-probabilities), on NumPy or CuPy; on the GPU
fewer where `gpu_memory` asks for it.

    nanoeuler hellaswag-eval --ckpt results/base.bin --data data/hellaswag/hellaswag.jsonl \\
        --name base --out results/hellaswag/base.json

Worked example: endings of 2 tokens with log-probs (-1, -3) and of 1 token with (-2.5,):
sums -4 and -2.5 (acc picks the second), means -2 and -2.5 (acc_norm picks the first).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections

DEFINITIONS = {
    "acc": "share of items whose right ending has the largest summed log-probability of its tokens",
    "acc_norm": "share of items whose right ending has the largest mean log-probability per ending token",
    "rows": "context tokens + tokens of ' ' + ending; only the ending's tokens are scored",
}


def item_rows(encode, item: dict, ctx_len: int) -> list[tuple[list[int], int]]:
    """The four (tokens, first scored position) rows of one item, each at most ctx_len + 1 tokens.

    `tokens[first:]` are the ending's tokens: the row is scored on predicting them.

        >>> item_rows(lambda s: [ord(c) for c in s], {"ctx": "ab", "endings": ["c", "d", "e", "fg"]}, 8)[3]
        ([97, 98, 32, 102, 103], 2)
    """
    ctx = encode(item["ctx"])
    rows = []
    for ending in item["endings"]:
        end = encode(" " + ending)
        tokens = (ctx + end)[-(ctx_len + 1) :]
        rows.append((tokens, max(1, len(tokens) - len(end))))
    return rows


def log_softmax_at(logits, targets, xp):
    """log p(target) from logits (..., V) and integer targets (...), in the logits' dtype."""
    top = logits.max(axis=-1, keepdims=True)
    lse = xp.log(xp.exp(logits - top).sum(axis=-1)) + top[..., 0]
    picked = xp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - lse


def score_rows(params: dict, cfg, rows: list[tuple[list[int], int]], xp) -> tuple[np.ndarray, np.ndarray]:
    """(summed, mean) log-probability of each row's scored tokens, as float64 NumPy arrays (R,)."""
    from nanoeuler.model import transformer

    length = max(len(tokens) for tokens, _ in rows)
    toks = np.zeros((len(rows), length), dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=np.float32)
    for r, (tokens, first) in enumerate(rows):
        toks[r, : len(tokens)] = tokens
        mask[r, first : len(tokens)] = 1.0
    logits = transformer.logits(params, toks[:, :-1], cfg)  # (R, L-1, V) on the params' device
    logp = log_softmax_at(logits, xp.asarray(toks[:, 1:]), xp)  # position t predicts token t+1
    logp = logp.get() if hasattr(logp, "get") else np.asarray(logp)
    m = mask[:, 1:]
    total = (logp.astype(np.float64) * m).sum(axis=1)
    return total, total / m.sum(axis=1)


def score_items(params: dict, cfg, encode, items: list[dict], batch_size: int, xp, desc: str = "hellaswag") -> dict:
    """Picks and accuracies over `items` (see the module docstring)."""
    from tqdm import tqdm

    picks, picks_norm, truncated, largest = [], [], 0, (0, 0)
    with tqdm(total=len(items), desc=desc, unit="item", disable=None) as bar:
        for lo in range(0, len(items), batch_size):
            batch = items[lo : lo + batch_size]
            rows = [row for item in batch for row in item_rows(encode, item, cfg.ctx_len)]
            truncated += sum(len(t) == cfg.ctx_len + 1 for t, _ in rows)
            total, mean = score_rows(params, cfg, rows, xp)
            length = max(len(t) for t, _ in rows) - 1  # the forward's padded length
            largest = max(largest, (len(batch), length), key=lambda b: b[0] * b[1])
            picks += total.reshape(-1, 4).argmax(axis=1).tolist()
            picks_norm += mean.reshape(-1, 4).argmax(axis=1).tolist()
            bar.update(len(batch))
    labels = [item["label"] for item in items]
    correct = sum(p == y for p, y in zip(picks, labels))
    correct_norm = sum(p == y for p, y in zip(picks_norm, labels))
    return {
        "items": len(items),
        "acc": correct / len(items),
        "acc_norm": correct_norm / len(items),
        "correct": correct,
        "correct_norm": correct_norm,
        "rows_at_context_limit": truncated,
        "chance": 0.25,
        "picks": picks,
        "picks_norm": picks_norm,
        "largest_forward": largest,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--ckpt", required=True, metavar="BIN", help="model file, e.g. results/base.bin")
    parser.add_argument("--data", required=True, metavar="JSONL", help="data/hellaswag/hellaswag.jsonl")
    parser.add_argument("--name", required=True, help="the model's name in the reports, e.g. base")
    parser.add_argument("--out", required=True, metavar="JSON", help="output, e.g. results/hellaswag/base.json")


def run(args: argparse.Namespace) -> int:
    from nanoeuler import memory
    from nanoeuler.data.common import atomic_path
    from nanoeuler.data.hellaswag import read_items
    from nanoeuler.files import check_outputs
    from nanoeuler.infer.engine import load

    check_outputs(out=args.out)
    conf = sections(args, "device", "gpu_memory", "eval")
    ev = conf["eval"]
    gen, tok, meta = load(args.ckpt, args.device or conf["device"], gpu_memory=conf["gpu_memory"])
    items = read_items(Path(args.data), ev["hellaswag_items"])
    budget = gen.budget
    cfg = gen.cfg
    resident = memory.decode_parts(cfg, 0) if budget is not None else {}
    per_batch, predict = memory.eval_items_for(
        "hellaswag-eval", budget, cfg, cfg.ctx_len, int(ev["hellaswag_batch_size"]), "logits", resident, rows_per_item=4
    )
    result = score_items(gen.params, cfg, tok.encode_ordinary, items, per_batch, gen.xp, desc=f"hellaswag {args.name}")
    items_in, length = result.pop("largest_forward")  # (items, padded length) of the largest forward
    if budget is not None:
        gen.meter.report(
            "hellaswag-eval",
            memory.peak(predict(items_in, length), budget.context),
            detail=f"{per_batch} items a forward",
        )
    result = {
        "model": args.name,
        "file": str(args.ckpt),
        "steps": meta.get("step"),
        **result,
        "definitions": DEFINITIONS,
    }
    with atomic_path(args.out) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(
        f"nanoeuler hellaswag-eval: {args.name}: acc {result['acc']:.4f}, acc_norm {result['acc_norm']:.4f} "
        f"on {result['items']} items; wrote {args.out}",
        file=sys.stderr,
    )
    return 0
