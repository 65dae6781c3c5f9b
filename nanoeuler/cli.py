"""The `nanoeuler` command: one subcommand per pipeline stage, plus tools.

Each subcommand lives in its own module, which defines

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> int        # exit status

Modules are imported only when their subcommand runs, so `nanoeuler --help` is
instant and a CPU-only install never imports CuPy.

Errors meant for the user are raised as `nanoeuler.errors.UserError`; `main`
prints them as one line (`nanoeuler <stage>: error: ...`) and exits with 1. So does an
OSError (a read-only folder, a full disk): it comes from the machine, not from a bug.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from nanoeuler import __version__
from nanoeuler.errors import UserError

# name -> (module, one-line help). Order is the order of the pipeline.
COMMANDS: dict[str, tuple[str, str]] = {
    "gutenberg": ("nanoeuler.data.gutenberg", "download Project Gutenberg books and strip the license text"),
    "fineweb": ("nanoeuler.data.fineweb", "download FineWeb-Edu parquet files and sample them with DuckDB"),
    "alpaca": ("nanoeuler.data.alpaca", "download, validate and clean the Alpaca instruction data"),
    "hellaswag": ("nanoeuler.data.hellaswag", "download and check the HellaSwag validation set"),
    "corpus": ("nanoeuler.data.corpus", "mix books and web text into train/val splits"),
    "tokenizer": ("nanoeuler.tokenizer.train", "learn byte-level BPE merges and write tokenizer.json"),
    "tokenize": ("nanoeuler.tokenizer.shards", "encode the corpus in parallel into uint16 token shards"),
    "pretrain": ("nanoeuler.train.pretrain", "pretrain the model on token shards (checkpoints, resume)"),
    "sft": ("nanoeuler.train.sft", "fine-tune the base model on Alpaca (loss on responses only)"),
    "hellaswag-eval": ("nanoeuler.eval.hellaswag", "score a model on HellaSwag (acc, acc_norm) as llm.c does"),
    "prefs": ("nanoeuler.data.prefs", "download and clean preference pairs (HH-RLHF, UltraFeedback, ShareGPT)"),
    "ref-logps": ("nanoeuler.train.reflogps", "the frozen chat model's log-probabilities of the preference pairs"),
    "dpo": ("nanoeuler.train.dpo", "tune the chat model on preference pairs with DPO"),
    "evaluate": ("nanoeuler.eval.report", "write samples.md, metrics.json and the loss plot"),
    "report-pages": (
        "nanoeuler.eval.pages",
        "HTML pages of a run's metrics, HellaSwag, samples, config for the report",
    ),
    "compare": ("nanoeuler.eval.compare", "one metrics table and one loss plot across experiments"),
    "sample": ("nanoeuler.infer.sample", "continue a prompt with a checkpoint"),
    "chat": ("nanoeuler.infer.chat", "talk to a chat checkpoint in the terminal"),
    "serve": ("nanoeuler.serve.server", "serve a chat model over an OpenAI-compatible HTTP API and a web page"),
    "gradcheck": ("nanoeuler.checks.gradcheck", "check every analytic gradient against finite differences"),
    "selftest": ("nanoeuler.checks.selftest", "check every GPU kernel against its NumPy reference"),
    "export-hf": ("nanoeuler.export.hf", "export a checkpoint as a Hugging Face Llama model"),
    "release": ("nanoeuler.export.release", "a finished run as a folder to share: HF model, checkpoint, model card"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoeuler",
        description="A GPT-2-class language model trained from scratch on NumPy/CuPy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="stages:\n"
        + "\n".join(f"  {name:<14} {text}" for name, (_, text) in COMMANDS.items())
        + "\n\nRun `nanoeuler <stage> --help` for the options of a stage.",
    )
    parser.add_argument("stage", choices=list(COMMANDS), metavar="stage", help="one of the stages below")
    parser.add_argument("--version", action="version", version=f"nanoeuler {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    if argv[0] not in COMMANDS:
        top.parse_args(argv[:1])  # prints "invalid choice" and exits 2
    name = argv[0]
    module_name, text = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"nanoeuler {name}", description=text)
    module = importlib.import_module(module_name)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.argv = argv[1:]  # the stage's own arguments, for `--gpus N` to start N processes with them
    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        print(f"nanoeuler {name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"nanoeuler {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output left (`nanoeuler sample ... | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit is quiet
        return 141
    except OSError as exc:  # the machine, not the code: a read-only folder, a full disk, a missing device
        print(f"nanoeuler {name}: error: {os_error(exc)}", file=sys.stderr)
        return 1


def os_error(exc: OSError) -> str:
    """One line for an OSError: what failed and on which file.

    >>> os_error(PermissionError(13, "Permission denied", "results/tokenizer.json"))
    'results/tokenizer.json: Permission denied'
    """
    what = exc.strerror or str(exc).strip() or type(exc).__name__
    files = [f for f in (exc.filename, exc.filename2) if f is not None]
    return ": ".join([" -> ".join(map(str, files)), what] if files else [what])


if __name__ == "__main__":
    sys.exit(main())
