"""`nanoeuler tokenizer`: learn byte-level BPE merges on a sample of the training corpus.

    nanoeuler tokenizer --config config/tiny.yaml --corpus data/corpus/train.parquet \\
        --out results/tokenizer.json --hf-out results/tokenizer.hf.json

The sample is a seeded random choice of whole documents (the last one cut to fit) adding up to
`tokenizer.sample_bytes` bytes of UTF-8, so a corpus sorted by source still gives a mixed sample, and
the same corpus and config give a byte-identical tokenizer.json. The corpus file is read in two
streaming passes (document sizes, then the picked texts), so a corpus of gigabytes never sits in memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import UserError
from nanoeuler.tokenizer.bpe import check_vocab_size, count_chunks, train_bpe, write_text_atomic
from nanoeuler.tokenizer.shards import open_corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--corpus", required=True, metavar="PARQUET", help="training corpus (column `text`)")
    parser.add_argument("--out", required=True, metavar="JSON", help="our tokenizer.json")
    parser.add_argument("--hf-out", metavar="JSON", help="also write a Hugging Face tokenizers tokenizer.json here")


def read_texts(path: str | Path) -> list[str]:
    """The `text` column of a corpus parquet file; a missing file/column or a null text is a UserError."""
    column = open_corpus(Path(path)).read(columns=["text"]).column("text")
    if column.null_count:
        row = column.is_null().to_pylist().index(True)
        raise UserError(f"corpus file {path}: row {row} has no text (null)")
    return column.to_pylist()


def pick(sizes: np.ndarray, sample_bytes: int, seed: int) -> list[tuple[int, int]]:
    """Which documents make the sample, in sample order: (index, bytes kept), the last one cut.

    Documents are taken in a seeded random order until `sample_bytes` UTF-8 bytes; all of them, in
    corpus order, when the corpus is no larger.

        >>> pick(np.array([4, 4, 4]), 6, seed=0)
        [(2, 4), (0, 2)]
    """
    if int(sizes.sum()) <= sample_bytes:
        return [(i, int(n)) for i, n in enumerate(sizes)]
    out, left = [], sample_bytes
    for i in np.random.default_rng(seed).permutation(len(sizes)).tolist():
        if left <= 0:
            break
        out.append((i, int(min(sizes[i], left))))
        left -= int(sizes[i])
    return out


def _cut(text: str, n_bytes: int) -> str:
    """The first `n_bytes` UTF-8 bytes of `text`, without a character cut in half."""
    data = text.encode("utf-8")
    return text if n_bytes >= len(data) else data[:n_bytes].decode("utf-8", errors="ignore")


def sample_texts(texts: list[str], sample_bytes: int, seed: int) -> list[str]:
    """Whole documents in a seeded random order until `sample_bytes` UTF-8 bytes (the last one cut)."""
    sizes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    return [_cut(texts[i], n) for i, n in pick(sizes, sample_bytes, seed)]


def sample_corpus(path: str | Path, sample_bytes: int, seed: int) -> list[str]:
    """`sample_texts` of a corpus parquet file, read in two streaming passes so that a corpus of many
    gigabytes never sits in memory: the documents' byte sizes first, then only the picked texts."""
    import pyarrow.compute as pc

    pf = open_corpus(Path(path))
    sizes, row = [], 0
    for batch in pf.iter_batches(columns=["text"], batch_size=8192):
        column = batch.column(0)
        if column.null_count:
            raise UserError(
                f"corpus file {path}: row {row + column.is_null().to_pylist().index(True)} has no text (null)"
            )
        sizes.append(pc.binary_length(column).to_numpy(zero_copy_only=False))
        row += len(column)
    chosen = pick(np.concatenate(sizes) if sizes else np.zeros(0, np.int64), sample_bytes, seed)
    keep = dict(chosen)
    texts: dict[int, str] = {}
    row = 0
    for batch in pf.iter_batches(columns=["text"], batch_size=8192):
        wanted = [i for i in range(row, row + batch.num_rows) if i in keep]
        if wanted:
            column = batch.column(0)
            for i in wanted:
                texts[i] = _cut(column[i - row].as_py(), keep[i])
        row += batch.num_rows
    return [texts[i] for i, _ in chosen]


def run(args: argparse.Namespace) -> int:
    from nanoeuler.files import check_outputs

    check_outputs(out=args.out, hf_out=args.hf_out)
    cfg = sections(args, "tokenizer")["tokenizer"]
    check_vocab_size(cfg["vocab_size"])
    t0 = time.perf_counter()
    sample = sample_corpus(args.corpus, cfg["sample_bytes"], cfg["seed"])
    n_bytes = sum(len(t.encode("utf-8")) for t in sample)
    counts = count_chunks(sample)
    if not counts:
        raise UserError(f"corpus file {args.corpus} holds no text to learn merges from")
    print(
        f"sample: {len(sample)} documents, {n_bytes:,} bytes, {len(counts):,} unique chunks "
        f"({time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    t1 = time.perf_counter()
    tok = train_bpe(counts, cfg["vocab_size"], progress=True)
    print(
        f"learned {len(tok.merges)} merges in {time.perf_counter() - t1:.1f} s; vocab_size {tok.vocab_size}",
        file=sys.stderr,
    )
    probe = "".join(sample)[:1_000_000]
    if probe:
        print(
            f"bytes/token on the first {len(probe.encode('utf-8')):,} bytes of the sample: "
            f"{len(probe.encode('utf-8')) / max(1, len(tok.encode(probe))):.2f}",
            file=sys.stderr,
        )
    tok.save(args.out)
    if args.hf_out:
        from nanoeuler.tokenizer.hf import to_hf_json

        write_text_atomic(Path(args.hf_out), to_hf_json(tok))
    print(
        f"wrote {args.out} (sha256 {tok.sha256[:12]})" + (f" and {args.hf_out}" if args.hf_out else ""), file=sys.stderr
    )
    return 0
