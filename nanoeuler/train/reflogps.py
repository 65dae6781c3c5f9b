"""`nanoeuler ref-logps`: the frozen chat model's log-probabilities of every preference pair, computed once.

    nanoeuler ref-logps --config config/tiny.yaml --ckpt results/chat.bin \\
        --prefs data/prefs/prefs.jsonl --out results/ref_logps.npz

DPO compares the policy with this reference; computing it here, as its own stage output, means the DPO
stage never holds two models in memory. The output `.npz` holds `logps` (N, 2) float64, the summed
response log-probabilities of pair i's chosen (column 0) and rejected (column 1) answer, tokenized and
cut to the context exactly as DPO does (`train.pairs`), and `meta`, a JSON string naming the prefs file's
sha256, the model's checksum and context, which DPO checks before it trains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
from pathlib import Path

import numpy as np

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import UserError
from nanoeuler.files import ARRAYS, check_outputs, open_input, parse_json

BATCH_PAIRS = 8  # pairs per forward pass at most (16 sequences; fewer where the GPU's memory asks for it);
# the values do not depend on it beyond rounding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--ckpt", required=True, metavar="BIN", help="the frozen reference, results/chat.bin")
    parser.add_argument("--prefs", required=True, metavar="JSONL", help="data/prefs/prefs.jsonl")
    parser.add_argument("--out", required=True, metavar="NPZ", help="e.g. results/ref_logps.npz")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def reference_meta(prefs_path, model_checksum: str, cfg, n_pairs: int) -> dict:
    """What a reference file must agree on with the DPO run that reads it."""
    from nanoeuler.train.pairs import file_sha256

    return {
        "prefs_sha256": file_sha256(prefs_path),
        "model_checksum": model_checksum,
        "ctx_len": cfg.ctx_len,
        "pairs": n_pairs,
    }


def load_reference(path, want: dict) -> np.ndarray:
    """The (N, 2) log-probabilities of a reference file, after checking its meta against `want`."""
    if not os.path.lexists(path):
        raise UserError(f"reference log-probs {path} do not exist (run `nanoeuler ref-logps` first)")
    try:
        with open_input(path, "reference log-probs file", ARRAYS) as f, np.load(f) as z:
            logps, meta = z["logps"], parse_json(str(z["meta"]), f"{path}: meta")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # a cut or foreign file
        raise UserError(
            f"reference log-probs {path} are unreadable ({type(exc).__name__}: {exc}); re-run `nanoeuler ref-logps`"
        ) from None
    if not isinstance(meta, dict):
        raise UserError(f"reference log-probs {path} are unreadable (its meta is not a JSON object)")
    diff = [k for k in want if meta.get(k) != want[k]]
    if diff:
        raise UserError(
            f"reference log-probs {path} were computed for other {', '.join(diff)} "
            "(another prefs file or chat model); re-run `nanoeuler ref-logps`"
        )
    if logps.shape != (want["pairs"], 2) or logps.dtype.kind != "f" or not np.isfinite(logps).all():
        raise UserError(
            f"reference log-probs {path} hold {logps.dtype} of shape {logps.shape} or non-finite values; "
            "re-run `nanoeuler ref-logps`"
        )
    return logps


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from nanoeuler import memory
    from nanoeuler.backend import get_xp
    from nanoeuler.data.common import atomic_path
    from nanoeuler.train.pairs import encode_pairs, load_chat_model, read_pairs, sequence_logps

    check_outputs(out=args.out)
    conf = sections(args, "device", "gpu_memory")
    xp = get_xp(args.device or conf["device"])
    meter = memory.PeakMeter(xp)
    budget = memory.Budget.on_device(conf["gpu_memory"], xp)
    params, cfg, _, tok, checksum = load_chat_model(args.ckpt)
    resident = {"params": memory.F32 * cfg.n_params()}
    chunk, predict = memory.eval_items_for(
        "ref-logps", budget, cfg, cfg.ctx_len, BATCH_PAIRS, "pair_logps", resident, rows_per_item=2
    )
    pairs = read_pairs(args.prefs)
    examples, counts = encode_pairs(pairs, tok, cfg.ctx_len)
    print(
        f"nanoeuler ref-logps: {len(examples)} pairs, {counts['truncated']} cut to the {cfg.ctx_len}-token "
        f"context ({counts['prompt_cut']} lost the start of the prompt)",
        file=sys.stderr,
        flush=True,
    )
    dev = {name: xp.asarray(p) for name, p in params.items()}
    logps = np.zeros((len(examples), 2))
    for lo in tqdm(
        range(0, len(examples), chunk),
        desc="ref-logps",
        unit="batch",
        file=sys.stderr,
        disable=args.no_progress,
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
    ):
        logps[lo : lo + chunk] = sequence_logps(dev, cfg, examples[lo : lo + chunk], chunk, tok.eot_id, xp)
    info = reference_meta(args.prefs, checksum, cfg, len(examples))
    out = Path(args.out)
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to the temporary's name
            np.savez(f, logps=logps, meta=np.array(json.dumps(info)))
    if budget is not None:
        meter.report("ref-logps", memory.peak(predict(chunk), budget.context), detail=f"{chunk} pairs a forward")
    print(
        f"nanoeuler ref-logps: wrote {out}: mean chosen {logps[:, 0].mean():.2f}, "
        f"rejected {logps[:, 1].mean():.2f} nats"
    )
    return 0
