"""Tokenizer benchmark: our BPE against HF `tokenizers` and tiktoken on the same text.

    python bench/tokenizer.py                                  # offline: English from the Python stdlib docs
    python bench/tokenizer.py --parquet data/corpus/train.parquet --mb 20
    python bench/tokenizer.py --text some.txt --vocab-size 4096

Measures, with one warm-up run and the median of --repeats runs:
- merge learning wall time (pretokenize + count + merges) vs HF's BpeTrainer (ByteLevel pre-tokenizer,
  same vocab size, same special tokens; HF uses every core, we use one);
- encode throughput in MB/s of UTF-8, one process and all cores, vs tiktoken (an Encoding built from
  our merges and the GPT-2 pattern) and HF tokenizers (our export); ids are checked to be identical;
- bytes/token on documents held out of merge learning (every 10th document).
The offline text is real English: the Python standard library's reference topics and the docstrings of
its modules, classes and functions (technical prose with code examples), the same on every machine with
the same Python version.
"""

from __future__ import annotations

import argparse
import ast
import multiprocessing as mp
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanoeuler.tokenizer import shards  # noqa: E402
from nanoeuler.tokenizer.bpe import GPT2_PATTERN, SPECIAL_TOKENS, Tokenizer, train_bpe  # noqa: E402
from nanoeuler.tokenizer.hf import to_hf_json  # noqa: E402


def stdlib_english() -> list[str]:
    """Documents of real English shipped with Python: reference topics + docstrings over 200 characters."""
    docs = []
    try:
        from pydoc_data.topics import topics

        docs += [topics[k] for k in sorted(topics)]
    except ImportError:
        pass
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "test", "tests", "idlelib"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    docs.append(doc)
    return docs


def load_docs(args) -> tuple[list[str], str]:
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8")
        docs = [d for d in text.split("\n\n") if d.strip()]
        source = f"{args.text} (paragraphs)"
    elif args.parquet:
        from nanoeuler.tokenizer.train import read_texts, sample_texts

        docs = sample_texts(read_texts(args.parquet), int(args.mb * 1e6), seed=0)
        source = f"{args.parquet} (seeded sample)"
    else:
        docs = stdlib_english()
        source = f"Python {platform.python_version()} stdlib docs (reference topics + docstrings)"
    if args.mb:
        budget, out = int(args.mb * 1e6), []
        for d in docs:
            if budget <= 0:
                break
            out.append(d)
            budget -= len(d.encode("utf-8"))
        docs = out
    return docs, source


def compare(fns: dict, repeats: int) -> dict[str, float]:
    """Median wall time per function: one warm-up each, then `repeats` rounds that run every function
    once in turn, so that load from other processes on the machine falls on all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _hf_trainer_run(docs, vocab_size):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(docs, trainer)
    return hf


def _ours_parallel(pool, workers, batches):
    return [ids for ids, _, _ in shards._encoded(iter(batches), pool, workers)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--text", help="a UTF-8 text file (documents = paragraphs)")
    src.add_argument("--parquet", help="a corpus parquet file (column text)")
    parser.add_argument("--mb", type=float, default=0, help="use at most this many MB of the text (0: all)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes/threads for 'all cores'")
    args = parser.parse_args()

    import tiktoken
    from tokenizers import Tokenizer as HFTokenizer

    docs, source = load_docs(args)
    train_docs = [d for i, d in enumerate(docs) if i % 10 != 9]
    held_out = [d for i, d in enumerate(docs) if i % 10 == 9]
    mb_all = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    mb_train = sum(len(d.encode("utf-8")) for d in train_docs) / 1e6
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    print(f"text: {source}: {len(docs)} documents, {mb_all:.2f} MB; merges learned on {mb_train:.2f} MB")
    print(
        f"machine: {cpu}, {os.cpu_count()} cores; Python {platform.python_version()}; "
        f"vocab {args.vocab_size}; median of {args.repeats} after 1 warm-up\n",
        flush=True,
    )

    rows = []
    tok = train_bpe(train_docs, args.vocab_size)
    t = compare(
        {
            "ours": lambda: train_bpe(train_docs, args.vocab_size),
            "hf": lambda: _hf_trainer_run(train_docs, args.vocab_size),
        },
        args.repeats,
    )
    rows.append(
        (
            "merge learning (s)",
            f"{t['ours']:.2f}",
            f"{t['hf']:.2f} (HF BpeTrainer)",
            f"{t['ours'] / t['hf']:.2f}x HF time",
        )
    )
    print(f"merge learning: ours {t['ours']:.2f} s, HF {t['hf']:.2f} s", flush=True)

    ranks = {tok.token_bytes(i): i for i in range(256 + len(tok.merges))}
    tik = tiktoken.Encoding(
        "nanoeuler-bench", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=tok.special_tokens
    )
    hf = HFTokenizer.from_str(to_hf_json(tok))
    expected = [tok.encode(d) for d in docs]
    assert [tik.encode_ordinary(d) for d in docs] == expected, "tiktoken ids differ from ours"
    assert [e.ids for e in hf.encode_batch(docs, add_special_tokens=False)] == expected, "HF ids differ from ours"

    def cold():
        fresh = Tokenizer(tok.merges, pattern=tok.pattern)
        return [fresh.encode(d) for d in docs]

    def row(label, ours, peer, peer_name):
        rows.append(
            (label, f"{mb_all / ours:.2f}", f"{mb_all / peer:.2f} ({peer_name})", f"{peer / ours:.2f}x {peer_name}")
        )

    t = compare(
        {
            "cold": cold,
            "warm": lambda: [tok.encode(d) for d in docs],
            "tiktoken": lambda: [tik.encode_ordinary(d) for d in docs],
            "hf": lambda: [hf.encode(d, add_special_tokens=False) for d in docs],
        },
        args.repeats,
    )
    row("encode 1 process, cold cache (MB/s)", t["cold"], t["tiktoken"], "tiktoken")
    row("encode 1 process, warm cache (MB/s)", t["warm"], t["tiktoken"], "tiktoken")
    row("encode 1 process (MB/s)", t["warm"], t["hf"], "HF tokenizers")
    print("encode, one process: done", flush=True)

    n = args.workers
    batches, batch, size = [], [], 0
    for d in docs:  # like the tokenize stage, in smaller batches so that every worker gets work
        batch.append(d)
        size += len(d)
        if size >= 64 * 1024:
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)
    shards._init_worker(tok.to_json())
    with mp.get_context("spawn").Pool(n, initializer=shards._init_worker, initargs=(tok.to_json(),)) as pool:
        t = compare(
            {
                "ours": lambda: _ours_parallel(pool, n, batches),
                "tiktoken": lambda: tik.encode_ordinary_batch(docs, num_threads=n),
                "hf": lambda: hf.encode_batch(docs, add_special_tokens=False),
            },
            args.repeats,
        )
    row(f"encode {n} processes, warm cache (MB/s)", t["ours"], t["tiktoken"], "tiktoken")
    row(f"encode {n} processes (MB/s)", t["ours"], t["hf"], "HF tokenizers")

    held = "\n\n".join(held_out)
    bpt = len(held.encode("utf-8")) / max(1, len(tok.encode(held)))
    rows.append(("bytes/token, held-out documents", f"{bpt:.2f}", "", ""))

    widths = [max(len(r[i]) for r in rows + [("", "ours", "peer", "ratio")]) for i in range(4)]
    header = ("", "ours", "peer", "ratio")
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
