"""`nanoeuler sample`: continue a prompt with a model file, printing tokens as they come.

    nanoeuler sample --ckpt results/base.bin --prompt "It was" --temperature 0.8 --seed 1

Generation stops at `<|endoftext|>` or `</s>` (neither is printed) or after --max-new-tokens.
Unset sampling options come from the config's `eval` section (--config), else its defaults. They are checked
as the server checks them (`sampling.checked_sampling`): finite numbers, --seed in [0, 2**63), and a
--temperature below 1e-6 is greedy, as 0 is; anything else is one line naming the option.
"""

from __future__ import annotations

import argparse
import sys

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import check_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--ckpt", required=True, metavar="BIN", help="model file, e.g. results/base.bin")
    parser.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    from nanoeuler.infer.engine import add_speculative_argument, add_threads_argument
    from nanoeuler.infer.sampling import add_sampling_arguments

    add_sampling_arguments(parser)
    add_threads_argument(parser)
    add_speculative_argument(parser)


def run(args: argparse.Namespace) -> int:
    from itertools import takewhile

    from nanoeuler.infer.engine import load
    from nanoeuler.infer.generate import decode_stream, fit_prompt
    from nanoeuler.infer.sampling import sampling_from

    check_text(args.prompt, "--prompt")
    conf = sections(args, "device", "gpu_memory", "eval")
    sampling, max_new = sampling_from(args, conf["eval"])
    gen, tok, _ = load(
        args.ckpt, args.device or conf["device"], args.speculative, conf["gpu_memory"], "sample", args.threads
    )
    ids = tok.encode(args.prompt) if args.prompt else [tok.eot_id]
    ids, dropped = fit_prompt(ids, gen.cfg.ctx_len, min(max_new, gen.cfg.ctx_len // 4))
    if dropped:
        print(
            f"[prompt left-truncated: dropped its first {dropped} tokens to fit the {gen.cfg.ctx_len}-token context]",
            file=sys.stderr,
        )
    stop = {tok.eot_id, tok.end_id}
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    for piece in decode_stream(tok, takewhile(lambda t: t not in stop, gen.stream(ids, max_new, sampling, stop))):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    gen.report_memory("sample", 1)
    return 0
