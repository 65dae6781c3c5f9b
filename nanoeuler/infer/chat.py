"""`nanoeuler chat`: a terminal REPL around a chat model.

    nanoeuler chat --ckpt results/chat.bin

Each line you type is one instruction: it is wrapped in the Alpaca template (single turn; earlier
turns are not part of the context), the answer streams as it is generated and ends at `</s>`.
Empty lines are ignored, a line that is not valid UTF-8 is refused with one line on stderr (the
session goes on); Ctrl-D (end of input) or `/quit` leaves; Ctrl-C stops the answer being generated.
A prompt longer than the context is left-truncated (its start is dropped) with a notice on stderr; an
answer that fills the context goes on in a sliding window (see `infer.generate`).
Turn n samples with seed + n, so a session is reproducible. Sampling options are checked as `sample` checks them.
"""

from __future__ import annotations

import argparse
import sys

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import UserError, check_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--ckpt", required=True, metavar="BIN", help="chat model file, e.g. results/chat.bin")
    from nanoeuler.infer.engine import add_speculative_argument, add_threads_argument
    from nanoeuler.infer.sampling import add_sampling_arguments

    add_sampling_arguments(parser)
    add_threads_argument(parser)
    add_speculative_argument(parser)


def answer(gen, tok, instruction: str, max_new: int, sampling, write) -> list[int]:
    """Generate one answer, passing text pieces to `write` as they decode; returns the answer's ids."""
    from nanoeuler.data.template import render_prompt
    from nanoeuler.infer.generate import decode_stream, fit_prompt

    ids = tok.encode(render_prompt(instruction))
    ids, dropped = fit_prompt(ids, gen.cfg.ctx_len, min(max_new, gen.cfg.ctx_len // 4))
    if dropped:
        print(
            f"[prompt left-truncated: dropped its first {dropped} tokens to fit the {gen.cfg.ctx_len}-token context]",
            file=sys.stderr,
            flush=True,
        )
    stop = {tok.end_id, tok.eot_id}
    out: list[int] = []

    def tokens():
        for t in gen.stream(ids, max_new, sampling, stop):
            if t in stop:
                return
            out.append(t)
            yield t

    try:
        for piece in decode_stream(tok, tokens()):
            write(piece)
    except KeyboardInterrupt:
        write(" [stopped]")
    return out


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from nanoeuler.infer.engine import load
    from nanoeuler.infer.sampling import sampling_from

    conf = sections(args, "device", "gpu_memory", "eval")
    sampling, max_new = sampling_from(args, conf["eval"])
    gen, tok, _ = load(
        args.ckpt, args.device or conf["device"], args.speculative, conf["gpu_memory"], "chat", args.threads
    )
    print(
        f"nanoeuler chat: {args.ckpt} ({gen.cfg.n_params():,} parameters, {gen.cfg.ctx_len}-token context). "
        "One instruction per line; Ctrl-D or /quit to leave.",
        file=sys.stderr,
        flush=True,
    )

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if hasattr(sys.stdin, "reconfigure"):  # bad bytes become lone surrogates, refused per line below
        sys.stdin.reconfigure(errors="surrogateescape")
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:
            write("\n")
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/quit", "/exit"):
            return 0
        try:
            check_text(line, "that line")
        except UserError as exc:  # one bad line ends nothing: say so and read the next
            print(f"nanoeuler chat: error: {exc}; try again", file=sys.stderr, flush=True)
            continue
        answer(gen, tok, line, max_new, replace(sampling, seed=sampling.seed + turn), write)
        write("\n")
        turn += 1
