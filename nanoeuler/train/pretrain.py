"""`nanoeuler pretrain`: train the model on the token shards, with checkpoints and exact resume.

    nanoeuler pretrain --config config/tiny.yaml --shards results/shards/manifest.json \\
        --tokenizer results/tokenizer.json --out results/base.bin

Re-running the same command resumes from the newest valid checkpoint in the run directory
(`results/pretrain/` next to `--out`); see `nanoeuler.train.loop` for the rules.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import UserError
from nanoeuler.train import parallel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--shards", required=True, metavar="MANIFEST", help="results/shards/manifest.json")
    parser.add_argument("--tokenizer", required=True, metavar="JSON", help="results/tokenizer.json")
    parser.add_argument("--out", required=True, metavar="BIN", help="final model, e.g. results/base.bin")
    parser.add_argument(
        "--run-dir", metavar="DIR", help="checkpoints, metrics.jsonl, loss.png (default: 'pretrain' next to --out)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parallel.add_gpus_argument(parser)


def _inputs(args: argparse.Namespace, model_section: dict):
    """(tokenizer, shard manifest, ModelConfig), checked to belong together."""
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.tokenizer.bpe import Tokenizer
    from nanoeuler.train.loader import read_manifest

    tok = Tokenizer.load(args.tokenizer)
    manifest = read_manifest(args.shards)
    if manifest.get("tokenizer_sha256") not in (None, tok.sha256):
        raise UserError(
            f"shards {args.shards} were made with another tokenizer than {args.tokenizer} "
            "(tokenizer_sha256 differs); re-run `nanoeuler tokenize`"
        )
    cfg = ModelConfig.from_section(model_section, tok.vocab_size)
    if int(manifest.get("vocab_size", cfg.vocab_size)) > cfg.vocab_size:
        raise UserError(
            f"shards {args.shards} use vocab_size {manifest['vocab_size']}, more than the tokenizer's {cfg.vocab_size}"
        )
    return tok, manifest, cfg


def run(args: argparse.Namespace) -> int:
    from nanoeuler import memory
    from nanoeuler.backend import get_xp
    from nanoeuler.files import check_outputs
    from nanoeuler.model.transformer import init_params
    from nanoeuler.train import loop, rundir
    from nanoeuler.train.config import PretrainConfig
    from nanoeuler.train.loader import RandomWindows, ShardSplit, fixed_windows
    from nanoeuler.train.metrics import val_metrics
    from nanoeuler.train.plots import plot_losses

    check_outputs(out=args.out)  # refused now, not after the training
    conf = sections(args, "device", "gpu_memory", "model", "pretrain")
    sec = conf["pretrain"]
    settings = PretrainConfig.from_section(sec)
    device = args.device or conf["device"]
    launched, dp = parallel.launch_or_setup("pretrain", args, sec, device)
    if launched is not None:
        return launched
    root = dp is None or dp.is_root
    xp = get_xp(device)

    tok, manifest, cfg = _inputs(args, conf["model"])
    T, K = cfg.ctx_len, cfg.mtp_heads
    train_split = ShardSplit(args.shards, "train", manifest)
    val_split = ShardSplit(args.shards, "val", manifest)
    windows = RandomWindows(
        train_split,
        T,
        K,
        settings.batch_size,
        settings.seed,
        rank=0 if dp is None else dp.rank,
        world=1 if dp is None else dp.size,
    )
    val = fixed_windows(val_split, T, K, settings.val_tokens)
    budget = memory.Budget.on_device(conf["gpu_memory"], xp)
    fit = memory.plan_training(
        "pretrain",
        cfg,
        settings,
        budget,
        eval_items=settings.batch_size,
        sm90a=memory.on_sm90a(xp),
        zero_world=parallel.zero_world(dp),
        dp_world=dp.size if dp is not None else 1,
    )

    class _Batches:
        def batch(self, step, micro):
            return windows.next_batch()

        state = staticmethod(windows.state)
        load_state = staticmethod(windows.load_state)

    def evaluate(params):
        return val_metrics(params, cfg, val, val_split.tokens, val_split.bytes, fit.eval_items, xp, budget is not None)

    out = Path(args.out)
    run_dir = Path(args.run_dir) if args.run_dir else out.parent / "pretrain"
    spec = loop.Run(
        stage="pretrain",
        cfg=cfg,
        section=sec,
        total_steps=settings.steps,
        batches=_Batches(),
        init_params=lambda: init_params(cfg, settings.seed, zero_out=settings.zero_init_out),
        tokenizer_json=tok.to_json(),
        tokenizer_sha256=tok.sha256,
        run_dir=run_dir,
        out=out,
        xp=xp,
        evaluate=evaluate,
        identity={"data": {"manifest_sha256": manifest["_sha256"]}},
        extra_out={"val_split": {"tokens": val_split.tokens, "bytes": val_split.bytes}},
        progress=not args.no_progress,
        parallel=dp,
        micro_rows=fit.micro,
        predicted_peak=fit.predicted,
    )
    last = loop.train(spec)
    if dp is not None:
        dp.close()
    if not root:
        return 0
    plot_losses([("pretraining", rundir.read_jsonl(run_dir / "metrics.jsonl"))], run_dir / "loss.png")
    print(
        f"nanoeuler pretrain: train loss {last.get('loss', float('nan')):.4f}, "
        f"val loss {last.get('val_loss', float('nan')):.4f}, val bits/byte {last.get('val_bpb', float('nan')):.4f}"
    )
    return 0
