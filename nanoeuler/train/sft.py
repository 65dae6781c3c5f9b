"""`nanoeuler sft`: fine-tune the base model on Alpaca records; the loss covers responses only.

    nanoeuler sft --config config/tiny.yaml --base results/base.bin \\
        --data data/alpaca/alpaca.jsonl --out results/chat.bin

Each record is rendered with the Alpaca template (`nanoeuler.data.template`), the response and
`</s>` appended; prompt and padding targets are -1. Records longer than the context are truncated
(`fit_example`: the response's tail goes first, then the prompt's start) or dropped
(`sft.too_long`); both are counted in the log. A few records (`sft.val_examples`, at most a
tenth) are held out to measure the response loss.

Batch order: epoch e visits the training records in the order of a permutation drawn from
`numpy.random.default_rng([seed, e])`, `batch_size` at a time (the last batch of an epoch may be
smaller). The order depends only on the step, so resuming needs no generator state. Training uses the
same loop, checkpoints and resume rules as pretraining (`results/sft/`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.data.template import render_prompt
from nanoeuler.errors import UserError

from nanoeuler.train import parallel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--base", required=True, metavar="BIN", help="the pretrained model, results/base.bin")
    parser.add_argument("--data", required=True, metavar="JSONL", help="data/alpaca/alpaca.jsonl")
    parser.add_argument("--out", required=True, metavar="BIN", help="the chat model, e.g. results/chat.bin")
    parser.add_argument("--run-dir", metavar="DIR", help="checkpoints and metrics (default: 'sft' next to --out)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parallel.add_gpus_argument(parser)


def read_records(path: str | Path) -> list[dict]:
    """Alpaca records from JSONL; a malformed line is an error naming the line."""
    from nanoeuler.data.common import jsonl_objects

    path = Path(path)
    if not os.path.lexists(path):  # lexists: a symlink loop is named as one by the reader
        raise UserError(f"Alpaca data {path} does not exist (run `nanoeuler alpaca` first)")
    records = []
    for n, rec in jsonl_objects(path, "Alpaca data"):
        for key in ("instruction", "output"):
            if not isinstance(rec.get(key), str):
                raise UserError(f"{path}:{n}: key '{key}' must be a string")
        if not isinstance(rec.get("input", ""), str):
            raise UserError(f"{path}:{n}: key 'input' must be a string")
        records.append(rec)
    if not records:
        raise UserError(f"Alpaca data {path} holds no records")
    return records


# ---- examples: the rendered prompt, the response, `</s>`; only the response and `</s>` are trained ----
# With K multi-token-prediction heads, head k's target at position t is token t+1+k when that position
# holds a response token, else -1:
#     tokens  = [p0 p1 p2 r0 r1 </s>]        prompt p*, response r*
#     inputs  = [p0 p1 p2 r0 r1]
#     head 0  = [-1 -1 r0 r1 </s>]
#     head 1  = [-1 r0 r1 </s> -1]


def encode_example(tokenizer, record: dict) -> tuple[list[int], int]:
    """(token ids of prompt + response + `</s>`, number of prompt tokens).

    User text is encoded with no special tokens allowed, so a literal "</s>" in the data is text;
    the end marker is appended by id.
    """
    prompt = tokenizer.encode(render_prompt(record["instruction"], record.get("input", "")))
    response = tokenizer.encode(record["output"]) + [tokenizer.end_id]
    return prompt + response, len(prompt)


def fit_example(ids: list[int], n_prompt: int, ctx_len: int, too_long: str) -> tuple[list[int], int] | None:
    """Make an example fit `ctx_len` inputs (ctx_len + 1 tokens): (ids, n_prompt), or None to drop it.

    `too_long`: "drop" discards an example that does not fit. "truncate" keeps the response's head:
    all of it that fits after the whole prompt, but at least ctx_len // 4 tokens; a prompt too long for
    that loses its start (left-truncation, as `nanoeuler chat` does with long prompts), so it still
    ends with "### Response:" followed by the response.

        >>> fit_example(list(range(12)), 4, ctx_len=8, too_long="truncate")   # prompt 0-3, response 4-11
        ([0, 1, 2, 3, 4, 5, 6, 7, 8], 4)
        >>> fit_example(list(range(12)), 10, ctx_len=8, too_long="truncate")  # prompt 0-9, response 10-11
        ([3, 4, 5, 6, 7, 8, 9, 10, 11], 7)
    """
    budget = ctx_len + 1
    if len(ids) <= budget:
        return ids, n_prompt
    if too_long == "drop":
        return None
    n_resp = len(ids) - n_prompt
    keep_resp = min(n_resp, max(budget - n_prompt, ctx_len // 4, 1))
    keep_prompt = budget - keep_resp
    return ids[n_prompt - keep_prompt : n_prompt + keep_resp], keep_prompt


def sft_batch(examples: list[tuple[list[int], int]], K: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad a batch of (ids, n_prompt) into inputs (B, T) and masked targets (B, T, K).

    T is the longest example's length minus one; padding positions hold `pad_id` as input and -1
    as target.
    """
    T = max(len(ids) for ids, _ in examples) - 1
    B = len(examples)
    inputs = np.full((B, T), pad_id, dtype=np.int64)
    targets = np.full((B, T, K), -1, dtype=np.int64)
    for b, (ids, n_prompt) in enumerate(examples):
        seq = np.asarray(ids, dtype=np.int64)
        L = seq.shape[0]
        inputs[b, : L - 1] = seq[: L - 1]
        for k in range(K):
            # position t's head-k target is seq[t+1+k]; trained only when that is a response token
            lo = max(n_prompt - 1 - k, 0)
            hi = L - 1 - k
            if hi > lo:
                targets[b, lo:hi, k] = seq[lo + 1 + k : hi + 1 + k]
    return inputs, targets


def prepare_examples(records, tok, ctx_len: int, too_long: str) -> tuple[list[tuple[list[int], int]], dict]:
    """Encode and fit records -> (examples (ids, n_prompt), counts).

    counts: truncated (cut to fit the context; prompt_cut of them lost the prompt's start) and dropped
    (too long with sft.too_long = drop).
    """
    out = []
    counts = {"truncated": 0, "prompt_cut": 0, "dropped": 0}
    for rec in records:
        ids, n_prompt = encode_example(tok, rec)
        fitted = fit_example(ids, n_prompt, ctx_len, too_long)
        if fitted is None:
            counts["dropped"] += 1
            continue
        counts["truncated"] += len(fitted[0]) < len(ids)
        counts["prompt_cut"] += fitted[1] < n_prompt
        out.append(fitted)
    return out, counts


class EpochBatches:
    """Micro-batch m of the run: epoch m // per_epoch, in the order of that epoch's seeded permutation.

    Rank `rank` of `world` data-parallel ranks takes examples rank, rank + world, ... of each batch of
    `world * batch_size`. Every rank needs an example a step, so an epoch's tail of fewer than `world`
    examples is left out (the next epoch's permutation puts other examples last)."""

    def __init__(
        self, examples, batch_size: int, grad_accum: int, seed: int, K: int, pad_id: int, rank: int = 0, world: int = 1
    ):
        self.examples, self.B, self.accum = examples, batch_size, grad_accum
        self.seed, self.K, self.pad_id = seed, K, pad_id
        self.rank, self.world = rank, world
        if len(examples) < world:
            raise UserError(f"{len(examples)} training examples cannot feed {world} ranks")
        full, tail = divmod(len(examples), batch_size * world)
        self.per_epoch = full + (tail >= world)
        self._perm: tuple[int, np.ndarray] | None = None
        self._last = (0, 0)

    def steps(self, epochs: int) -> int:
        return math.ceil(epochs * self.per_epoch / self.accum)

    def batch(self, step: int, micro: int = 0):
        m = step * self.accum + micro
        epoch, i = divmod(m, self.per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.examples)))
        wide = self.B * self.world
        idx = self._perm[1][i * wide : (i + 1) * wide][self.rank :: self.world]
        self._last = (epoch, i + 1)
        return sft_batch([self.examples[j] for j in idx], self.K, self.pad_id)

    def state(self) -> dict:
        return {"epoch": self._last[0], "batches_done_in_epoch": self._last[1]}

    def load_state(self, state: dict) -> None:
        pass  # the order is a function of the step


def response_loss(params, cfg, examples, batch_size: int, pad_id: int, xp) -> dict:
    """Loss over held-out examples' response tokens, weighted by each batch's head-0 targets; `batch_size`
    examples a forward (sized by the stage to its memory, `memory.eval_items_for`)."""
    from nanoeuler.model import transformer

    tot = ce = weight = 0.0
    for lo in range(0, len(examples), batch_size):
        x, y = sft_batch(examples[lo : lo + batch_size], cfg.mtp_heads, pad_id)
        n = float((y[:, :, 0] >= 0).sum())
        if n == 0:
            continue
        loss, heads = transformer.forward_loss(params, xp.asarray(x), xp.asarray(y), cfg)
        tot += loss * n
        ce += heads[0] * n
        weight += n
    if weight == 0:
        return {}
    return {"val_loss": tot / weight, "val_ce": ce / weight, "val_tokens": int(weight)}


def _base_tokenizer(base, meta: dict):
    """The tokenizer stored in the base model's metadata; a missing or unreadable one is an error naming it."""
    from nanoeuler.tokenizer.bpe import Tokenizer

    if not meta.get("tokenizer"):
        raise UserError(f"base model {base} carries no tokenizer (metadata 'tokenizer')")
    try:
        return Tokenizer.from_json(meta["tokenizer"])
    except UserError as exc:
        raise UserError(f"base model {base}: its tokenizer is unreadable: {exc}") from None


def split_records(records: list, settings) -> tuple[list, list]:
    """(training records, held-out records): the first `max_examples` (0: all), of which `val_examples`
    (at most a tenth) drawn by a permutation seeded by `seed` are held out; both keep the file's order."""
    if settings.max_examples:
        records = records[: settings.max_examples]
    n_val = min(settings.val_examples, len(records) // 10)
    order = np.random.default_rng(settings.seed).permutation(len(records))
    return [records[i] for i in sorted(order[n_val:])], [records[i] for i in sorted(order[:n_val])]


def _examples(data: str, tok, ctx_len: int, settings, verbose: bool):
    """(training examples, held-out examples, counts of truncated/dropped records) from the Alpaca JSONL."""
    train_records, val_records = split_records(read_records(data), settings)
    examples, counts = prepare_examples(train_records, tok, ctx_len, settings.too_long)
    val_examples, _ = prepare_examples(val_records, tok, ctx_len, settings.too_long)
    if verbose:
        print(
            f"nanoeuler sft: {len(train_records)} training records: {len(examples)} used, "
            f"{counts['truncated']} truncated to the {ctx_len}-token context "
            f"({counts['prompt_cut']} of them lost the start of the prompt), "
            f"{counts['dropped']} dropped as too long (sft.too_long = {settings.too_long}); "
            f"{len(val_examples)} held out for validation",
            file=sys.stderr,
            flush=True,
        )
    if not examples:
        raise UserError(f"no Alpaca record of {data} fits the {ctx_len}-token context (try sft.too_long: truncate)")
    return examples, val_examples, counts


def run(args: argparse.Namespace) -> int:
    from nanoeuler import checkpoint, memory
    from nanoeuler.backend import get_xp
    from nanoeuler.files import DATA_JSONL, check_outputs, file_sha256
    from nanoeuler.train import loop, rundir
    from nanoeuler.train.config import SftConfig
    from nanoeuler.train.plots import plot_losses

    check_outputs(out=args.out)  # refused now, not after the training
    conf = sections(args, "device", "gpu_memory", "sft")
    sec = conf["sft"]
    settings = SftConfig.from_section(sec)
    device = args.device or conf["device"]
    launched, dp = parallel.launch_or_setup("sft", args, sec, device)
    if launched is not None:
        return launched
    root = dp is None or dp.is_root
    xp = get_xp(device)

    params, cfg, meta = checkpoint.load_model(args.base)
    tok = _base_tokenizer(args.base, meta)
    base_checksum = checkpoint.read_header(args.base)[1].get("checksum")

    data_sha = file_sha256(args.data, "Alpaca data", DATA_JSONL)
    examples, val_examples, counts = _examples(args.data, tok, cfg.ctx_len, settings, verbose=root)

    pad_id = tok.eot_id
    budget = memory.Budget.on_device(conf["gpu_memory"], xp)
    fit = memory.plan_training(
        "sft",
        cfg,
        settings,
        budget,
        eval_items=settings.batch_size,
        sm90a=memory.on_sm90a(xp),
        zero_world=parallel.zero_world(dp),
        dp_world=dp.size if dp is not None else 1,
    )
    batches = EpochBatches(
        examples,
        settings.batch_size,
        settings.grad_accum,
        settings.seed,
        cfg.mtp_heads,
        pad_id,
        rank=0 if dp is None else dp.rank,
        world=1 if dp is None else dp.size,
    )

    def evaluate(p):
        return response_loss(p, cfg, val_examples, fit.eval_items, pad_id, xp)

    out = Path(args.out)
    run_dir = Path(args.run_dir) if args.run_dir else out.parent / "sft"
    spec = loop.Run(
        stage="sft",
        cfg=cfg,
        section=sec,
        total_steps=batches.steps(settings.epochs),
        batches=batches,
        init_params=lambda: params,
        tokenizer_json=meta["tokenizer"],
        tokenizer_sha256=tok.sha256,
        run_dir=run_dir,
        out=out,
        xp=xp,
        evaluate=evaluate if val_examples else None,
        identity={"data": {"alpaca_sha256": data_sha, "base_checksum": base_checksum}},
        extra_out={"sft_data": {"train_examples": len(examples), "val_examples": len(val_examples), **counts}},
        progress=not args.no_progress,
        foreign_model_is_error=False,
        parallel=dp,
        micro_rows=fit.micro,
        predicted_peak=fit.predicted,
    )
    last = loop.train(spec)
    if dp is not None:
        dp.close()
    if not root:
        return 0
    plot_losses([("SFT", rundir.read_jsonl(run_dir / "metrics.jsonl"))], run_dir / "loss.png")
    print(
        f"nanoeuler sft: train loss {last.get('loss', float('nan')):.4f}, "
        f"held-out response loss {last.get('val_loss', float('nan')):.4f}"
    )
    return 0
