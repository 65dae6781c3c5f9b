"""`nanoeuler tokenize`: encode the train/val corpus into uint16 token shards plus a manifest.

    nanoeuler tokenize --config config/tiny.yaml --tokenizer results/tokenizer.json \\
        --train data/corpus/train.parquet --val data/corpus/val.parquet \\
        --out results/shards/manifest.json --workers 2

Each split is one token stream: every document's ids followed by `<|endoftext|>`, in corpus order, cut
into shards of `shards.shard_tokens` tokens (the last one shorter) named `{split}_{i:04d}.npy` next to
the manifest. Documents are grouped into batches of about `_BATCH_CHARS` characters in corpus order and
encoded by a pool of processes; results are taken back in submission order, so the shards do not depend
on the number of processes. Shards are written into a temporary folder and moved into place at the end,
the manifest last, so an error leaves no partial output.

manifest.json:
    {"format": 1, "tokenizer_sha256": ..., "vocab_size": V, "eot_id": id, "dtype": "uint16",
     "splits": {"train": {"shards": [{"file": "train_0000.npy", "tokens": N}, ...],
                          "tokens": N, "bytes": B, "documents": D}, "val": {...}}}
`bytes` counts the UTF-8 bytes of the split's documents (for bits per byte).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import UserError
from nanoeuler.files import SMALL_JSON, check_input, check_outputs, naming, parse_json, read_text
from nanoeuler.tokenizer.bpe import MAX_VOCAB, Tokenizer, write_text_atomic

MANIFEST_FORMAT = 1
SPLITS = ("train", "val")
_BATCH_CHARS = 1 << 20  # text per task sent to a worker
_SHARD_NAME = re.compile(r"^(train|val)_\d{4}\.npy$")

_worker_tok: Tokenizer | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--tokenizer", required=True, metavar="JSON", help="our tokenizer.json")
    parser.add_argument("--train", required=True, metavar="PARQUET", help="training split (column `text`)")
    parser.add_argument("--val", required=True, metavar="PARQUET", help="validation split (column `text`)")
    parser.add_argument("--out", required=True, metavar="JSON", help="manifest.json; shards go next to it")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="encoding processes (default 1)")


# ---- reading ------------------------------------------------------------------------------------


def open_corpus(path: Path):
    """A pyarrow ParquetFile with a string `text` column, or a UserError saying what is wrong."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_input(path, "corpus file")  # a missing file, a directory, a device or FIFO: one line
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"corpus file {path} is not a readable parquet file: {str(exc).splitlines()[0]}") from None
    if "text" not in pf.schema_arrow.names:
        raise UserError(f"corpus file {path} has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
    column_type = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise UserError(f"column 'text' of {path} must hold strings, got {column_type}")
    return pf


def iter_batches(pf, path: Path) -> Iterator[list[str]]:
    """Lists of documents (about _BATCH_CHARS characters each) from the `text` column, in order."""
    batch, chars, row = [], 0, 0
    for record_batch in pf.iter_batches(columns=["text"], batch_size=4096):
        for text in record_batch.column(0).to_pylist():
            if text is None:
                raise UserError(f"corpus file {path}: row {row} has no text (null)")
            batch.append(text)
            chars += len(text)
            row += 1
            if chars >= _BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


# ---- encoding -----------------------------------------------------------------------------------


def _init_worker(tokenizer_json: str) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.from_json(tokenizer_json)


def _encode_docs(texts: list[str]) -> tuple[np.ndarray, int]:
    """One batch -> (uint16 ids with <|endoftext|> after each document, UTF-8 bytes of the batch)."""
    tok = _worker_tok
    eot = tok.eot_id
    ids: list[int] = []
    n_bytes = 0
    for text in texts:
        ids.extend(tok.encode_ordinary(text))
        ids.append(eot)
        n_bytes += len(text.encode("utf-8"))
    return np.array(ids, dtype=np.uint16), n_bytes


def _encoded(batches: Iterator[list[str]], pool, workers: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """(ids, bytes, documents) per batch, in input order; at most a few batches in flight."""
    if pool is None:
        for texts in batches:
            ids, n_bytes = _encode_docs(texts)
            yield ids, n_bytes, len(texts)
        return
    pending: deque = deque()
    limit = 2 * workers + 2
    for texts in batches:
        pending.append((pool.apply_async(_encode_docs, (texts,)), len(texts)))
        if len(pending) >= limit:
            result, n_docs = pending.popleft()
            yield (*result.get(), n_docs)
    while pending:
        result, n_docs = pending.popleft()
        yield (*result.get(), n_docs)


class _ShardWriter:
    """Cuts a token stream into fixed-size .npy shards inside `folder`."""

    def __init__(self, folder: Path, split: str, shard_tokens: int):
        self.folder, self.split = folder, split
        self.buf = np.empty(shard_tokens, dtype=np.uint16)
        self.fill = 0
        self.shards: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        start = 0
        while start < len(ids):
            take = min(len(ids) - start, len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + take] = ids[start : start + take]
            self.fill += take
            start += take
            if self.fill == len(self.buf):
                self.flush()

    def flush(self) -> None:
        if self.fill == 0:
            return
        name = f"{self.split}_{len(self.shards):04d}.npy"
        with naming(self.folder / name), open(self.folder / name, "wb") as f:  # a full disk names the shard
            np.save(f, self.buf[: self.fill])
            f.flush()
            os.fsync(f.fileno())
        self.shards.append({"file": name, "tokens": int(self.fill)})
        self.fill = 0


def tokenize_split(path: Path, split: str, folder: Path, shard_tokens: int, pool, workers: int) -> dict:
    """Encode one parquet split into shards in `folder`; returns its manifest entry."""
    from tqdm import tqdm

    writer = _ShardWriter(folder, split, shard_tokens)
    total_bytes = documents = tokens = 0
    pf = open_corpus(path)
    with tqdm(
        desc=f"tokenize {split}", total=pf.metadata.num_rows, unit="doc", file=sys.stderr, mininterval=1.0
    ) as bar:
        for ids, n_bytes, n_docs in _encoded(iter_batches(pf, path), pool, workers):
            writer.add(ids)
            total_bytes += n_bytes
            documents += n_docs
            tokens += len(ids)
            bar.update(n_docs)
    writer.flush()
    if documents == 0:
        raise UserError(f"corpus file {path} holds no documents: the {split} split would be empty")
    return {"shards": writer.shards, "tokens": tokens, "bytes": total_bytes, "documents": documents}


def previous_shards(manifest_path: Path) -> set[str]:
    """Shard names that an earlier manifest at `manifest_path` lists (none when it is absent or not ours).

    Only plain shard names count, so a hand-edited manifest cannot point the clean-up elsewhere.
    """
    try:
        old = parse_json(read_text(manifest_path, "shard manifest", SMALL_JSON), str(manifest_path))
    except UserError:
        return set()
    splits = old.get("splits") if isinstance(old, dict) else None
    names = set()
    for split in splits.values() if isinstance(splits, dict) else ():
        for shard in split.get("shards", []) if isinstance(split, dict) else ():
            name = shard.get("file") if isinstance(shard, dict) else None
            if isinstance(name, str) and _SHARD_NAME.match(name):
                names.add(name)
    return names


def tokenize_corpus(
    tok: Tokenizer, inputs: dict[str, Path], manifest_path: Path, shard_tokens: int, workers: int = 1
) -> dict:
    """Encode every split, move the shards next to `manifest_path`, then write the manifest. Returns it."""
    if tok.vocab_size > MAX_VOCAB:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens; uint16 shards hold at most {MAX_VOCAB}")
    if shard_tokens < 1:
        raise UserError(f"shards.shard_tokens must be at least 1, got {shard_tokens}")
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    out_dir = manifest_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".shards-", dir=out_dir))
    pool = None
    try:
        tok_json = tok.to_json()
        _init_worker(tok_json)
        if workers > 1:
            pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tok_json,))
        splits = {
            name: tokenize_split(Path(path), name, tmp, shard_tokens, pool, workers) for name, path in inputs.items()
        }
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        manifest = {
            "format": MANIFEST_FORMAT,
            "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "dtype": "uint16",
            "splits": splits,
        }
        # swap in: old manifest out first, then shards, then the new manifest; of the old shards only
        # those its manifest lists are removed, never another file that merely looks like a shard
        keep = {s["file"] for split in splits.values() for s in split["shards"]}
        stale = previous_shards(manifest_path) - keep
        manifest_path.unlink(missing_ok=True)
        for name in stale:
            (out_dir / name).unlink(missing_ok=True)
        for name in sorted(keep):
            os.replace(tmp / name, out_dir / name)
        write_text_atomic(manifest_path, json.dumps(manifest, indent=2) + "\n")
        return manifest
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    check_outputs(out=args.out)
    cfg = sections(args, "shards")["shards"]
    tok = Tokenizer.load(args.tokenizer)
    manifest = tokenize_corpus(
        tok, {"train": Path(args.train), "val": Path(args.val)}, Path(args.out), cfg["shard_tokens"], args.workers
    )
    for name, split in manifest["splits"].items():
        print(
            f"{name}: {split['documents']:,} documents, {split['bytes']:,} bytes -> {split['tokens']:,} tokens "
            f"({split['bytes'] / max(1, split['tokens']):.2f} bytes/token) in {len(split['shards'])} shard(s)",
            file=sys.stderr,
        )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
