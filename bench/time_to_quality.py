"""Time to quality: how many tokens and seconds each training recipe needs to reach a validation bits/byte.

    python bench/time_to_quality.py run --shards S/manifest.json --tokenizer tok.json --out runs/ \
        adamw_6e-4 adamw_1.2e-3 muon_6e-3          # each recipe a full `nanoeuler pretrain`, one after another
    python bench/time_to_quality.py report runs/ --plot docs/time_to_quality.png

A recipe is named `<optimizer>_<lr>[_<steps>][+<extra>...]`; RECIPES says what each optimizer's recipe
changes in the schema's pretraining defaults (on config/config.yaml's model and tokenizer: the bf16 engine,
the full `gpu` model, B32 x T512, val bits/byte every `--eval-every` steps). `adamw_<lr>` is the schema's
default recipe (AdamW, warmup + cosine) at peak lr `<lr>`; `muon_<lr>` is the new one (Muon on the hidden
matrices at muon_lr `<lr>`, AdamW on the rest at `--adam-lr`, warmup-stable-decay, zero-initialised
output projections). `<steps>` overrides `--steps`. EXTRAS are keys laid on top: `+mtp` fades the MTP
heads' loss weights from [1, .5, .25, .125] to [1, 0, 0, 0] over the run (as the GPT-2 speedrun's
records do), so `muon_2e-3+mtp` is the best Muon of the first sweep with that schedule.

A schedule that ends where the target is wanted reaches it soonest: `muon_2e-3_1750` reaches the tuned
AdamW's best in 0.58x its tokens where `muon_2e-3` (3000 steps) needs 0.75x; `muon_1.4e-3_1750+mtp` in
0.42x (BENCHMARKS.md). Runs take ~1-2 minutes each on an H200, one a GPU on a host of several
(scripts/device_x4.sh).

`report` takes the tuned baseline (the AdamW run with the lowest val bits/byte; or, for a folder of new
recipes only, `--baseline BPB,STEP,SECONDS`: the best val bits/byte of an earlier sweep's tuned AdamW run,
the step it reached it at and its training seconds to it) and, for every run: its
best val bits/byte within the baseline's token budget, the tokens and the training seconds it needed to
reach the baseline's best (the first evaluation at or below it), and the step time (median of the logged
intervals: tokens / (tokens/s), evaluation and checkpoints excluded, as the training loop measures them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# each optimizer's recipe: pretraining keys over config/config.yaml (the lr is the recipe name's)
RECIPES = {
    "adamw": lambda lr, adam_lr: {"optimizer": "adamw", "lr": lr, "min_lr": lr / 10, "schedule": "cosine"},
    "muon": lambda lr, adam_lr: {
        "optimizer": "muon",
        "muon_lr": lr,
        "lr": adam_lr,
        "min_lr": 0.0,
        "schedule": "wsd",
        "cooldown_frac": 0.4,
        "warmup_steps": 100,
        "zero_init_out": True,
    },
}
# keys over a recipe's, named after a `+` (the gpu preset's 4 output heads)
EXTRAS = {
    "mtp": {"mtp_weights": [1.0, 0.5, 0.25, 0.125], "mtp_weights_end": [1.0, 0.0, 0.0, 0.0]},
}


def recipe_keys(name: str, steps: int, adam_lr: float) -> dict:
    """The pretraining keys of a recipe name `<optimizer>_<lr>[_<steps>][+<extra>...]`.

    >>> recipe_keys("adamw_1.2e-3", 3000, 6e-4)["lr"], recipe_keys("muon_6e-3_1800", 3000, 1e-3)["steps"]
    (0.0012, 1800)
    >>> recipe_keys("muon_2e-3+mtp", 3000, 6e-4)["mtp_weights_end"]
    [1.0, 0.0, 0.0, 0.0]
    """
    base, *extras = name.split("+")
    opt, lr, *tail = base.split("_")
    keys = RECIPES[opt](float(lr), adam_lr)
    keys["steps"] = int(tail[0]) if tail else steps
    for extra in extras:
        keys.update(EXTRAS[extra])
    return keys


def write_config(path: Path, keys: dict, eval_every: int) -> None:
    import yaml

    base = yaml.safe_load((ROOT / "config" / "config.yaml").read_text()) or {}
    # the pretraining section is the recipe's alone (over the schema's defaults, today's AdamW recipe),
    # whatever recipe config.yaml itself names
    pre = dict(precision="bf16", eval_every=eval_every, log_every=50, checkpoint_every=keys["steps"], **keys)
    base.update(device="gpu", pretrain=pre)
    path.write_text(yaml.safe_dump(base, sort_keys=False))


def run(args) -> int:
    out = Path(args.out)
    for name in args.recipes:
        work = out / name
        work.mkdir(parents=True, exist_ok=True)
        keys = recipe_keys(name, args.steps, args.adam_lr)
        write_config(work / "config.yaml", keys, args.eval_every)
        t0 = time.perf_counter()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "nanoeuler",
                "pretrain",
                "--config",
                str(work / "config.yaml"),
                "--shards",
                args.shards,
                "--tokenizer",
                args.tokenizer,
                "--out",
                str(work / "base.bin"),
                "--run-dir",
                str(work / "run"),
                "--no-progress",
            ],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
        )
        (work / "stderr.txt").write_text(r.stderr[-20000:])
        print(f"{name}: exit {r.returncode}, {time.perf_counter() - t0:.0f} s", flush=True)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
        (work / "base.bin").unlink(missing_ok=True)  # keep the metrics, not the weights
    return 0


def load_run(work: Path) -> dict:
    """{name, steps, val: [(step, bpb)], seconds: {step: training seconds to it}, step_ms}."""
    recs = [json.loads(line) for line in open(work / "run" / "metrics.jsonl")]
    import yaml

    keys = yaml.safe_load((work / "config.yaml").read_text())["pretrain"]
    tokens_per_step = 32 * 512
    val = [(r["step"], r["val_bpb"]) for r in recs if "val_bpb" in r]
    seconds, t, last, intervals = {0: 0.0}, 0.0, 0, []
    for r in recs:
        if "tokens_per_s" in r:
            dt = (r["step"] - last) * tokens_per_step / r["tokens_per_s"]
            t += dt
            intervals.append(dt / max(1, r["step"] - last))
            last = r["step"]
            seconds[r["step"]] = t
    return {
        "name": work.name,
        "steps": keys["steps"],
        "val": val,
        "seconds": seconds,
        "step_ms": 1e3 * statistics.median(intervals[1:] or intervals),
        "keys": keys,
        "tokens_per_step": tokens_per_step,
    }


def reach(run: dict, target: float):
    """(step, tokens, seconds) of the first evaluation at or below target, or None."""
    for step, bpb in run["val"]:
        if bpb <= target + 1e-12:
            secs = run["seconds"].get(step)
            if secs is None:  # evaluation steps are logging steps (50 divides 250); else interpolate
                below = max(s for s in run["seconds"] if s <= step)
                secs = run["seconds"][below] + (step - below) * run["step_ms"] / 1e3
            return step, step * run["tokens_per_step"], secs
    return None


def report(args) -> int:
    runs = [load_run(p) for p in sorted(Path(args.runs).iterdir()) if (p / "run" / "metrics.jsonl").exists()]
    base = [r for r in runs if r["keys"]["optimizer"] == "adamw"]
    if args.baseline:  # an earlier sweep's tuned AdamW: its best, the step it reached it at, seconds to it
        target, t_step, t_secs = (float(v) for v in args.baseline.split(","))
        name, t_step, budget = "given", int(t_step), int(t_step)
        t_tokens = t_step * (runs[0]["tokens_per_step"] if runs else 32 * 512)
    elif base:
        tuned = min(base, key=lambda r: min(b for _, b in r["val"]))
        target = min(b for _, b in tuned["val"])
        t_step, t_tokens, t_secs = reach(tuned, target)
        name, budget = tuned["name"], tuned["steps"]
    else:
        print(f"no AdamW run in {args.runs} to take as the baseline: give --baseline BPB,STEP,SECONDS", file=sys.stderr)
        return 1
    print(
        f"tuned baseline: {name}, best val bits/byte {target:.4f} at step {t_step} "
        f"({t_tokens / 1e6:.1f}M tokens, {t_secs:.0f} s of training)\n"
    )
    print(
        "| recipe | steps | step (ms) | best val bpb within the baseline's budget | tokens to reach "
        f"{target:.4f} | x baseline | training s to reach | x baseline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        best = min((b for s, b in r["val"] if s <= budget), default=float("nan"))
        got = reach(r, target)
        if got is None:
            cells = "not reached | | not reached |"
        else:
            cells = f"{got[1] / 1e6:.1f}M | {got[1] / t_tokens:.2f} | {got[2]:.0f} | {got[2] / t_secs:.2f} |"
        print(f"| {r['name']} | {r['steps']} | {r['step_ms']:.1f} | {best:.4f} | {cells}")
    if args.plot:
        plot(runs, target, Path(args.plot))
    return 0


def plot(runs: list, target: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    lowest = min(b for r in runs for _, b in r["val"])
    for r in runs:
        style = "-" if r["keys"]["optimizer"] == "muon" else "--"
        xs = [s * r["tokens_per_step"] / 1e6 for s, _ in r["val"]]
        ys = [b for _, b in r["val"]]
        axes[0].plot(xs, ys, style, marker="o", markersize=3, label=r["name"])
        secs = [reach({**r, "val": [(s, -1e9)]}, 0)[2] for s, _ in r["val"]]
        axes[1].plot(secs, ys, style, marker="o", markersize=3, label=r["name"])
    for ax, xl in zip(axes, ("tokens (M)", "training seconds")):
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel(xl)
        ax.set_ylabel("val bits/byte")
        ax.set_ylim(min(target - 0.1, lowest - 0.02), target + 0.5)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("time to quality: the full model on the mirror's corpus, B32 x T512")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--shards", required=True)
    r.add_argument("--tokenizer", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--steps", type=int, default=3000)
    r.add_argument("--eval-every", type=int, default=250)
    r.add_argument(
        "--adam-lr",
        type=float,
        default=6e-4,
        help="the muon recipes' AdamW lr (embedding, heads, gains; config/config.yaml's)",
    )
    r.add_argument("recipes", nargs="+")
    q = sub.add_parser("report")
    q.add_argument("runs")
    q.add_argument("--plot")
    q.add_argument(
        "--baseline", help="BPB,STEP,SECONDS of an earlier sweep's tuned AdamW run (BENCHMARKS.md: 1.2380,3000,85)"
    )
    args = p.parse_args()
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
