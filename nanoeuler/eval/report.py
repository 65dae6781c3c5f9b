"""`nanoeuler evaluate`: samples, validation metrics and the loss plot of a finished run.

    nanoeuler evaluate --config config/tiny.yaml --base results/base.bin --chat results/chat.bin \\
        --shards results/shards/manifest.json --samples results/samples.md \\
        --metrics results/metrics.json --plot results/loss.png

- `metrics.json`: val loss, head-0 cross-entropy and bits per byte (see `nanoeuler.train.metrics`) of
  the base and the chat model on the same fixed val windows, plus what training recorded, and the
  HellaSwag scores of `--hellaswag` (files of `nanoeuler hellaswag-eval`).
- `samples.md`: base-model continuations of `eval.base_prompts` and chat answers to
  `eval.chat_prompts` (prompt i sampled with `eval.seed + i`), the metrics, and the loss plot.
- `loss.png`: train/val loss of pretraining and SFT, from the run directories' `metrics.jsonl`.
- With `--dpo results/dpo.bin` (config `eval.dpo`), the DPO model's val metrics and held-out DPO
  scores join metrics.json, and samples.md shows its answer to each chat prompt under the chat model's
  (same prompt, same seed).

All three files are written only after everything is computed, each atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import UserError
from nanoeuler.files import read_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--base", required=True, metavar="BIN", help="results/base.bin")
    parser.add_argument("--chat", required=True, metavar="BIN", help="results/chat.bin")
    parser.add_argument("--shards", required=True, metavar="MANIFEST", help="results/shards/manifest.json (val split)")
    parser.add_argument("--samples", required=True, metavar="MD", help="output, e.g. results/samples.md")
    parser.add_argument("--metrics", required=True, metavar="JSON", help="output, e.g. results/metrics.json")
    parser.add_argument("--plot", required=True, metavar="PNG", help="output, e.g. results/loss.png")
    parser.add_argument(
        "--hellaswag",
        nargs="*",
        default=[],
        metavar="JSON",
        help="HellaSwag results of `nanoeuler hellaswag-eval`, one file per model",
    )
    parser.add_argument("--dpo", metavar="BIN", help="results/dpo.bin: report the DPO model beside the chat model")
    parser.add_argument(
        "--pretrain-dir", metavar="DIR", help="pretraining run dir (default: 'pretrain' next to --base)"
    )
    parser.add_argument("--sft-dir", metavar="DIR", help="SFT run dir (default: 'sft' next to --chat)")
    from nanoeuler.infer.engine import add_speculative_argument

    add_speculative_argument(parser)
    from nanoeuler.infer.engine import add_threads_argument

    add_threads_argument(parser)


def _write_text(path: Path, text: str) -> None:
    from nanoeuler.data.common import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _fence(text: str) -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _fmt(x, nd=4) -> str:
    return f"{x:.{nd}f}" if isinstance(x, (int, float)) else "–"


DEFINITIONS = {
    "val_loss": "training objective on the fixed val windows: mean over MTP heads of each head's mean "
    "cross-entropy, nats",
    "val_ce": "head-0 (next-token) mean cross-entropy per token on the fixed val windows, nats",
    "val_bpb": "bits per UTF-8 byte = val_ce / ln 2 * val_split_tokens / val_split_bytes",
    "val_set": "consecutive non-overlapping windows of ctx_len + mtp_heads tokens from the start of "
    "the val split, eval.val_tokens input tokens at most",
}


def _load_models(args: argparse.Namespace, device: str, gpu_memory="auto") -> tuple[list[tuple], object]:
    """[(name, generation engine, metadata, path)] of base, chat and (with --dpo) the DPO model, each
    checked to carry the tokenizer of the model it was tuned from; the base tokenizer last."""
    from nanoeuler.infer.engine import load

    spec, threads = getattr(args, "speculative", None), getattr(args, "threads", None)
    base, base_tok, base_meta = load(args.base, device, spec, gpu_memory, "evaluate", threads)
    chat, chat_tok, chat_meta = load(args.chat, device, spec, gpu_memory, "evaluate", threads)
    if base_tok.sha256 != chat_tok.sha256:
        raise UserError(
            f"{args.chat} and {args.base} carry different tokenizers; the chat model must be "
            "fine-tuned from this base model"
        )
    models = [("base", base, base_meta, args.base), ("chat", chat, chat_meta, args.chat)]
    if args.dpo:
        dpo, dpo_tok, dpo_meta = load(args.dpo, device, None, gpu_memory, "evaluate", threads)
        if dpo_tok.sha256 != chat_tok.sha256:
            raise UserError(
                f"{args.dpo} and {args.chat} carry different tokenizers; the DPO model must be "
                "tuned from this chat model"
            )
        models.append(("dpo", dpo, dpo_meta, args.dpo))
    _share_memory([m[1] for m in models])
    return models, base_tok


def _share_memory(engines) -> None:
    """All models stay loaded: each engine's generation batch fits beside the others' weights (the budget
    was measured before the first one loaded)."""
    from nanoeuler import memory

    budget = engines[0].budget
    if budget is None:
        return
    held = [memory.decode_parts(e.cfg, 0) for e in engines]
    for i, e in enumerate(engines):
        others = {f"{k}_{j}": v for j, h in enumerate(held) if j != i for k, v in h.items()}
        e.budget = budget
        e.max_batch = memory.decode_batch("evaluate", budget, e.cfg, e.max_batch, others)


def _model_metrics(models, val_split, ev: dict) -> dict:
    """{model name: its validation metrics and what it was trained on}."""
    from nanoeuler.train.loader import fixed_windows
    from nanoeuler.train.metrics import val_metrics

    out = {}
    for name, gen, meta, path in models:
        cfg = gen.cfg
        val = fixed_windows(val_split, cfg.ctx_len, cfg.mtp_heads, int(ev["val_tokens"]))
        print(f"nanoeuler evaluate: val loss of {name} ({val[0].size} tokens)", file=sys.stderr, flush=True)
        rows = _val_rows(models, gen, int(ev["batch_size"]))
        m = val_metrics(gen.params, cfg, val, val_split.tokens, val_split.bytes, rows, gen.xp, gen.budget is not None)
        out[name] = {
            **m,
            "file": str(path),
            "params": cfg.n_params(),
            "model_config": cfg.to_dict(),
            "steps": meta.get("step"),
            "training": meta.get("final_metrics", {}),
        }
        out[name].update({key: meta[key] for key in ("sft_data", "dpo_data") if key in meta})
    return out


def _val_rows(models, gen, most: int) -> int:
    """Validation windows a forward of `gen` takes beside every loaded model (`memory.eval_items_for`)."""
    from nanoeuler import memory

    if gen.budget is None:
        return most
    held = {f"{k}_{j}": v for j, m in enumerate(models) for k, v in memory.decode_parts(m[1].cfg, 0).items()}
    return memory.eval_items_for("evaluate", gen.budget, gen.cfg, gen.cfg.ctx_len, most, "loss", held)[0]


def _samples(models, tok, ev: dict, sampling) -> tuple[list, list]:
    """The base model's continuations of eval.base_prompts (one batch; prompt i samples with seed + i)
    and the chat (and DPO) answers to eval.chat_prompts."""
    from nanoeuler.infer.chat import answer
    from nanoeuler.infer.generate import fit_prompt

    base, tuned = models[0][1], [m[1] for m in models[1:]]
    n_new = int(ev["max_new_tokens"])
    stop = {tok.eot_id, tok.end_id}
    prompts = [
        fit_prompt(tok.encode(p) if p else [tok.eot_id], base.cfg.ctx_len, min(n_new, base.cfg.ctx_len // 4))[0]
        for p in ev["base_prompts"]
    ]
    outs = base.generate(prompts, n_new, sampling, stop)
    base_samples = [(p, tok.decode([t for t in out if t not in stop])) for p, out in zip(ev["base_prompts"], outs)]
    chat_samples = []
    for i, prompt in enumerate(ev["chat_prompts"]):
        texts = []
        for gen in tuned:
            pieces: list[str] = []
            answer(gen, tok, prompt, n_new, replace(sampling, seed=sampling.seed + i), pieces.append)
            texts.append("".join(pieces))
        chat_samples.append((prompt, *texts))
    return base_samples, chat_samples


def _training_runs(args: argparse.Namespace) -> list[tuple[str, list]]:
    """[(title, metrics records)] of pretraining and SFT, for the loss plot (a missing log is a warning)."""
    from nanoeuler.train.rundir import read_jsonl

    pre_dir = Path(args.pretrain_dir) if args.pretrain_dir else Path(args.base).parent / "pretrain"
    sft_dir = Path(args.sft_dir) if args.sft_dir else Path(args.chat).parent / "sft"
    runs = []
    for title, run_dir in (("pretraining", pre_dir), ("SFT", sft_dir)):
        recs = read_jsonl(run_dir / "metrics.jsonl")
        if not recs:
            print(
                f"nanoeuler evaluate: warning: no {title} metrics found in {run_dir}; the plot leaves them out",
                file=sys.stderr,
            )
        runs.append((title, recs))
    return runs


def run(args: argparse.Namespace) -> int:
    from nanoeuler.files import check_outputs
    from nanoeuler.infer.sampling import Sampling
    from nanoeuler.train.loader import ShardSplit, read_manifest
    from nanoeuler.train.plots import plot_losses

    check_outputs(samples=args.samples, metrics=args.metrics, plot=args.plot)
    conf = sections(args, "device", "gpu_memory", "eval")
    ev = conf["eval"]
    hellaswag = read_hellaswag(args.hellaswag)  # before the long work: a bad file stops the stage at once
    models, tok = _load_models(args, args.device or conf["device"], conf["gpu_memory"])
    manifest = read_manifest(args.shards)
    if manifest.get("tokenizer_sha256") not in (None, tok.sha256):
        raise UserError(f"shards {args.shards} were made with another tokenizer than the one in {args.base}")
    val_split = ShardSplit(args.shards, "val", manifest)

    metrics: dict = {
        "definitions": DEFINITIONS,
        "val_split": {"tokens": val_split.tokens, "bytes": val_split.bytes},
        **_model_metrics(models, val_split, ev),
    }
    sampling = Sampling(
        temperature=float(ev["temperature"]), top_k=int(ev["top_k"]), top_p=float(ev["top_p"]), seed=int(ev["seed"])
    )
    base_samples, chat_samples = _samples(models, tok, ev, sampling)
    runs = _training_runs(args)
    if hellaswag:
        metrics["hellaswag"] = hellaswag
    metrics["sampling"] = {
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "max_new_tokens": int(ev["max_new_tokens"]),
    }

    plot = Path(args.plot)
    plot_losses(runs, plot)
    _write_text(Path(args.metrics), json.dumps(metrics, indent=2) + "\n")
    samples = Path(args.samples)
    _write_text(samples, _markdown(metrics, base_samples, chat_samples, os.path.relpath(plot, samples.parent)))
    _report_memory(models, int(ev["batch_size"]), len(ev["base_prompts"]))
    print(
        f"nanoeuler evaluate: base val bpb {_fmt(metrics['base']['val_bpb'])}, chat val bpb "
        f"{_fmt(metrics['chat']['val_bpb'])}; wrote {samples}, {args.metrics}, {plot}",
        file=sys.stderr,
    )
    return 0


def _report_memory(models, val_rows: int, prompts: int) -> None:
    """The measured peak against the larger prediction: validation beside every model, or generation."""
    from nanoeuler import memory

    gen = models[0][1]
    if gen.budget is None:
        return
    held = {f"{k}_{j}": v for j, m in enumerate(models) for k, v in memory.decode_parts(m[1].cfg, 0).items()}
    rows = _val_rows(models, gen, val_rows)
    val = {**held, **memory.forward_parts(gen.cfg, rows, gen.cfg.ctx_len, "loss", params=False)}
    decode = {**held, **memory.decode_parts(gen.cfg, min(prompts, gen.max_batch or prompts))}
    decode = {k: v for k, v in decode.items() if k not in ("params", "weights")}  # held already counts them
    gen.meter.report(
        "evaluate",
        memory.peak(max(val, decode, key=lambda p: sum(p.values())), gen.budget.context),
        detail=f"{rows} windows a forward",
    )


def read_hellaswag(paths: list[str]) -> dict:
    """{model: its HellaSwag scores} from `hellaswag-eval` outputs, without the per-item picks."""
    out = {}
    for path in paths:
        result = read_json(path, "HellaSwag result")
        try:
            out[result["model"]] = {
                k: result[k] for k in ("items", "acc", "acc_norm", "correct", "correct_norm", "steps", "file")
            }
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{path} is not a HellaSwag result of `nanoeuler hellaswag-eval`: {exc!r}") from None
    return out


def _hellaswag_markdown(scores: dict) -> list[str]:
    lines = ["## HellaSwag", "", "| model | items | acc | acc_norm |", "|---|---:|---:|---:|"]
    for name, s in scores.items():
        lines.append(
            f"| {name} | {s['items']:,} | {s['acc']:.4f} ({s['correct']}) | {s['acc_norm']:.4f} ({s['correct_norm']}) |"
        )
    return lines + [
        "",
        "Completion-style, as llm.c: `acc` picks the ending with the largest summed log-probability "
        "of its tokens, `acc_norm` the largest mean per token. Chance is 0.25.",
        "",
    ]


def _markdown(metrics: dict, base_samples, chat_samples, plot_rel: str) -> str:
    s = metrics["sampling"]
    lines = ["# nanoeuler samples", ""]
    lines += [
        "## Metrics",
        "",
        "| model | params | steps | val loss | val CE (head 0) | val bits/byte |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in [n for n in ("base", "chat", "dpo") if n in metrics]:
        m = metrics[name]
        lines.append(
            f"| {name} | {m['params']:,} | {m['steps']} | {_fmt(m['val_loss'])} | {_fmt(m['val_ce'])} | "
            f"{_fmt(m['val_bpb'])} |"
        )
    lines += [
        "",
        f"Validation: {metrics['base']['val_tokens']:,} tokens of the val split. "
        "Bits per byte = head-0 cross-entropy / ln 2 × (val tokens / val bytes).",
        "",
    ]
    if "dpo" in metrics:  # a metric of the DPO model: with the others, not among the samples
        t = metrics["dpo"]["training"]
        lines += [
            "DPO on held-out preference pairs: reward accuracy "
            f"{_fmt(t.get('reward_accuracy'), 3)}, mean margin {_fmt(t.get('margin'))}, chosen / rejected "
            f"log-prob {_fmt(t.get('chosen_logp'), 2)} / {_fmt(t.get('rejected_logp'), 2)} nats.",
            "",
        ]
    lines += [
        f"![loss curves]({plot_rel})",
        "",
        f"Sampling: temperature {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}, "
        f"at most {s['max_new_tokens']} new tokens, seed {s['seed']} + prompt index.",
        "",
    ]
    if "hellaswag" in metrics:
        lines += _hellaswag_markdown(metrics["hellaswag"])
    lines += ["## Base model continuations", ""]
    for prompt, text in base_samples:
        lines += [f"**Prompt:** `{prompt}`", "", _fence(prompt + text), ""]
    lines += ["## Chat answers", ""]
    for prompt, text, *dpo_text in chat_samples:
        lines += [f"**Instruction:** {prompt}", "", _fence(text), ""]
        if dpo_text:  # the DPO model's answer to the same prompt, same seed
            lines += ["*DPO model:*", "", _fence(dpo_text[0]), ""]
    return "\n".join(lines)
