"""`nanoeuler dpo`: tune the chat model on preference pairs with Direct Preference Optimization.

    nanoeuler dpo --config config/tiny.yaml --ckpt results/chat.bin --prefs data/prefs/prefs.jsonl \\
        --ref results/ref_logps.npz --out results/dpo.bin

The stage is three things on top of the shared training loop (`train.loop`: checkpoints, exact resume,
divergence stop, metrics, progress bar): the loss (`model.dpo.dpo_head_loss`, a head loss on the final
normed state), a batch source (`PairBatches`: P pairs as 2P rows, with their reference log-probabilities
from `nanoeuler ref-logps`), and the held-out scoring. The loss is a `model.dpo.DpoHead`: the fp32 xp path
(CPU, or CuPy on the GPU) calls it as a head loss, and with `dpo.precision: bf16` the GPU engine runs it
as its sequence log-probability head (`kernels/bf16/engine.py`, head "dpo").

A few pairs (`dpo.val_pairs`, at most a fifth, drawn by seed) are held out; every `eval_every` steps the
log gets their DPO loss, reward accuracy (the share with a positive margin), mean margin
beta * ((logp_c - ref_c) - (logp_r - ref_r)), and the mean chosen and rejected log-probabilities.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--ckpt", required=True, metavar="BIN", help="the chat model to start from, results/chat.bin")
    parser.add_argument("--prefs", required=True, metavar="JSONL", help="data/prefs/prefs.jsonl")
    parser.add_argument("--ref", required=True, metavar="NPZ", help="results/ref_logps.npz (nanoeuler ref-logps)")
    parser.add_argument("--out", required=True, metavar="BIN", help="the tuned model, e.g. results/dpo.bin")
    parser.add_argument("--run-dir", metavar="DIR", help="checkpoints and metrics (default: 'dpo' next to --out)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


class PairBatches:
    """Micro-batch m of the run: `batch_size` pairs of epoch m // per_epoch, in that epoch's seeded order.

    `head` is the loop's loss (a `model.dpo.DpoHead`): it trains each micro-batch against that batch's
    reference values, which `batch` queues in the order the loop will ask for the gradients."""

    def __init__(self, examples, ref: np.ndarray, sec: dict, K: int, pad_id: int):
        self.examples, self.ref, self.K, self.pad_id = examples, ref, K, pad_id
        self.B, self.accum, self.seed = int(sec["batch_size"]), int(sec["grad_accum"]), int(sec["seed"])
        from nanoeuler.model.dpo import DpoHead

        self.head = DpoHead(float(sec["beta"]), float(sec["label_smoothing"]))
        self.per_epoch = math.ceil(len(examples) / self.B)

    def steps(self, epochs: int) -> int:
        return math.ceil(epochs * self.per_epoch / self.accum)

    def batch(self, step: int, micro: int = 0):
        from nanoeuler.train.pairs import pair_batch

        epoch, i = divmod(step * self.accum + micro, self.per_epoch)
        idx = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))[i * self.B : (i + 1) * self.B]
        self.head.push(np.concatenate([self.ref[idx, 0], self.ref[idx, 1]]))
        return pair_batch([self.examples[j] for j in idx], self.K, self.pad_id)

    def split(self, batch: list, pairs: int) -> list:
        """The step's micro-batches cut into pieces of at most `pairs` pairs (to fit the device), each with
        its share of the queued reference values (`loop.Run.split`)."""
        from nanoeuler.train.pairs import pair_pieces

        refs = [self.head.pop() for _ in batch]
        out = []
        for (x, y), ref in zip(batch, refs):
            for px, py, pref in pair_pieces(x, y, ref, pairs):
                self.head.push(pref)
                out.append((px, py))
        return out

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass  # the order is a function of the step


def pair_metrics(logps: np.ndarray, ref: np.ndarray, beta: float, eps: float) -> dict:
    """Held-out scores from policy and reference log-probabilities (N, 2), chosen in column 0."""
    from nanoeuler.model.dpo import pair_loss

    loss, _, h = pair_loss(
        np.concatenate([logps[:, 0], logps[:, 1]]), np.concatenate([ref[:, 0], ref[:, 1]]), beta, eps
    )
    return {
        "val_loss": loss,
        "reward_accuracy": float((h > 0).mean()),
        "margin": float(h.mean()),
        "chosen_logp": float(logps[:, 0].mean()),
        "rejected_logp": float(logps[:, 1].mean()),
    }


def run(args: argparse.Namespace) -> int:
    from nanoeuler import memory
    from nanoeuler.backend import get_xp
    from nanoeuler.files import check_outputs
    from nanoeuler.train import loop, rundir
    from nanoeuler.train.config import TrainConfig
    from nanoeuler.train.pairs import (
        encode_pairs,
        file_sha256,
        load_chat_model,
        read_pairs,
        sequence_logps,
        split_pairs,
    )
    from nanoeuler.train.plots import plot_losses
    from nanoeuler.train.reflogps import load_reference, reference_meta

    check_outputs(out=args.out)  # refused now, not after the training
    conf = sections(args, "device", "gpu_memory", "dpo")
    sec = conf["dpo"]
    xp = get_xp(args.device or conf["device"])
    params, cfg, meta, tok, checksum = load_chat_model(args.ckpt)
    pairs = read_pairs(args.prefs)
    ref = load_reference(args.ref, reference_meta(args.prefs, checksum, cfg, len(pairs)))
    examples, _ = encode_pairs(pairs, tok, cfg.ctx_len)

    n_val = min(int(sec["val_pairs"]), len(examples) // 5)
    train_idx, val_idx = split_pairs(len(examples), n_val, int(sec["seed"]))
    val_examples, val_ref = [examples[i] for i in val_idx], ref[val_idx]
    print(
        f"nanoeuler dpo: {len(train_idx)} training pairs, {n_val} held out; beta {sec['beta']}, "
        f"label smoothing {sec['label_smoothing']}",
        file=sys.stderr,
        flush=True,
    )
    if n_val:
        print(
            f"nanoeuler dpo: the chat model prefers the chosen answer (higher log-prob) in "
            f"{(val_ref[:, 0] > val_ref[:, 1]).mean():.3f} of the held-out pairs",
            file=sys.stderr,
            flush=True,
        )
    batches = PairBatches([examples[i] for i in train_idx], ref[train_idx], sec, cfg.mtp_heads, tok.eot_id)
    budget = memory.Budget.on_device(conf["gpu_memory"], xp)
    fit = memory.plan_training(
        "dpo",
        cfg,
        TrainConfig.from_section(sec),
        budget,
        eval_items=int(sec["batch_size"]),
        eval_kind="pair_logps",
        rows_per_item=2,
        unit=" pairs",
        head="dpo",
        sm90a=memory.on_sm90a(xp),
    )

    def evaluate(p):
        logps = sequence_logps(p, cfg, val_examples, fit.eval_items, tok.eot_id, xp)
        return pair_metrics(logps, val_ref, float(sec["beta"]), float(sec["label_smoothing"]))

    out = Path(args.out)
    run_dir = Path(args.run_dir) if args.run_dir else out.parent / "dpo"
    spec = loop.Run(
        stage="dpo",
        cfg=cfg,
        section=sec,
        total_steps=batches.steps(int(sec["epochs"])),
        batches=batches,
        init_params=lambda: params,
        tokenizer_json=meta["tokenizer"],
        tokenizer_sha256=tok.sha256,
        run_dir=run_dir,
        out=out,
        xp=xp,
        evaluate=evaluate if val_examples else None,
        identity={"data": {"prefs_sha256": file_sha256(args.prefs), "chat_checksum": checksum}},
        extra_out={"dpo_data": {"train_pairs": len(train_idx), "val_pairs": n_val}},
        progress=not args.no_progress,
        foreign_model_is_error=False,
        head_loss=batches.head,
        micro_rows=fit.micro,
        split=batches.split,
        predicted_peak=fit.predicted,
    )
    last = loop.train(spec)
    plot_losses([("DPO", rundir.read_jsonl(run_dir / "metrics.jsonl"))], run_dir / "loss.png")
    print(
        f"nanoeuler dpo: train loss {last.get('loss', float('nan')):.4f}; held-out reward accuracy "
        f"{last.get('reward_accuracy', float('nan')):.3f}, margin {last.get('margin', float('nan')):.4f}"
    )
    return 0
