"""`nanoeuler tokenize`: shards, manifest, independence from the number of processes, errors."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanoeuler import cli
from nanoeuler.errors import UserError
from nanoeuler.tokenizer import shards
from nanoeuler.tokenizer.bpe import Tokenizer, train_bpe
from test_bpe import SAMPLES, TRAIN_TEXT

DOCS = TRAIN_TEXT.split("\n\n") + SAMPLES + [f"document number {i}: " + "words " * (i % 7) for i in range(60)]


def write_corpus(path, texts):
    pq.write_table(
        pa.table(
            {
                "source": ["test"] * len(texts),
                "doc_id": [str(i) for i in range(len(texts))],
                "text": pa.array(texts, type=pa.string()),
            }
        ),
        path,
        row_group_size=16,
    )
    return path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(TRAIN_TEXT, vocab_size=400)


@pytest.fixture
def corpus(tmp_path):
    return {
        "train": write_corpus(tmp_path / "train.parquet", DOCS),
        "val": write_corpus(tmp_path / "val.parquet", DOCS[::-1][:20]),
    }


def read_split(manifest_path, split):
    manifest = json.loads(manifest_path.read_text())
    parts = [np.load(manifest_path.parent / s["file"], mmap_mode="r") for s in manifest["splits"][split]["shards"]]
    return np.concatenate(parts)


def test_manifest_and_stream(tok, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "_BATCH_CHARS", 3000)  # several batches
    path = tmp_path / "out" / "manifest.json"
    manifest = shards.tokenize_corpus(tok, corpus, path, shard_tokens=1000, workers=1)
    assert json.loads(path.read_text()) == manifest
    assert manifest["format"] == 1 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer_sha256"] == tok.sha256 and manifest["vocab_size"] == 400
    assert manifest["eot_id"] == tok.eot_id
    for split, docs in (("train", DOCS), ("val", DOCS[::-1][:20])):
        info = manifest["splits"][split]
        expected = [i for d in docs for i in tok.encode(d) + [tok.eot_id]]
        stream = read_split(path, split)
        assert stream.dtype == np.uint16 and stream.ndim == 1
        assert stream.tolist() == expected  # every document followed by <|endoftext|>
        assert info["tokens"] == len(expected) == sum(s["tokens"] for s in info["shards"])
        assert info["documents"] == len(docs)
        assert info["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
        assert [s["tokens"] for s in info["shards"][:-1]] == [1000] * (len(info["shards"]) - 1)
        assert [s["file"] for s in info["shards"]] == [f"{split}_{i:04d}.npy" for i in range(len(info["shards"]))]
        for s in info["shards"]:
            assert np.load(path.parent / s["file"]).shape == (s["tokens"],)
        pieces = tok.decode(stream.tolist()).split("<|endoftext|>")
        assert pieces[:-1] == docs and pieces[-1] == ""
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".npy")) == ["manifest.json"]


@pytest.mark.parametrize("workers", [2, 3])
def test_same_output_for_any_number_of_workers(tok, corpus, tmp_path, monkeypatch, workers):
    monkeypatch.setattr(shards, "_BATCH_CHARS", 2000)
    one = tmp_path / "one" / "manifest.json"
    many = tmp_path / "many" / "manifest.json"
    shards.tokenize_corpus(tok, corpus, one, shard_tokens=700, workers=1)
    shards.tokenize_corpus(tok, corpus, many, shard_tokens=700, workers=workers)
    assert one.read_bytes() == many.read_bytes()
    files = sorted(p.name for p in one.parent.iterdir())
    assert files == sorted(p.name for p in many.parent.iterdir())
    for name in files:
        assert (one.parent / name).read_bytes() == (many.parent / name).read_bytes()


def test_rerun_replaces_old_shards(tok, corpus, tmp_path):
    path = tmp_path / "out" / "manifest.json"
    first = shards.tokenize_corpus(tok, corpus, path, shard_tokens=300, workers=1)
    second = shards.tokenize_corpus(tok, corpus, path, shard_tokens=10**6, workers=1)
    assert len(first["splits"]["train"]["shards"]) > 1 and len(second["splits"]["train"]["shards"]) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json", "train_0000.npy", "val_0000.npy"]
    assert read_split(path, "train").tolist() == [i for d in DOCS for i in tok.encode(d) + [tok.eot_id]]


def test_vocab_over_uint16_is_rejected(corpus, tmp_path):
    pairs = [(a, b) for a in range(256) for b in range(256)][: 65535 - 256 - 2 + 1]
    big = Tokenizer(pairs)
    assert big.vocab_size == 65536
    path = tmp_path / "out" / "manifest.json"
    with pytest.raises(UserError, match="uint16"):
        shards.tokenize_corpus(big, corpus, path, shard_tokens=1000)
    assert not path.exists()


def test_cli(tok, corpus, tmp_path, capsys):
    tok_path = tmp_path / "tokenizer.json"
    tok.save(tok_path)
    out = tmp_path / "shards" / "manifest.json"
    params = json.dumps({"shards": {"shard_tokens": 5000}})
    argv = [
        "tokenize",
        "--params",
        params,
        "--tokenizer",
        str(tok_path),
        "--train",
        str(corpus["train"]),
        "--val",
        str(corpus["val"]),
        "--out",
        str(out),
        "--workers",
        "2",
    ]
    assert cli.main(argv) == 0
    manifest = json.loads(out.read_text())
    assert manifest["splits"]["train"]["shards"][0] == {"file": "train_0000.npy", "tokens": 5000}
    assert "bytes/token" in capsys.readouterr().err


def test_cli_errors_leave_no_output(tok, corpus, tmp_path, capsys):
    tok_path = tmp_path / "tokenizer.json"
    tok.save(tok_path)
    out = tmp_path / "shards" / "manifest.json"

    def run(train=corpus["train"], val=corpus["val"], tokenizer=tok_path, extra=()):
        code = cli.main(
            [
                "tokenize",
                "--tokenizer",
                str(tokenizer),
                "--train",
                str(train),
                "--val",
                str(val),
                "--out",
                str(out),
                *extra,
            ]
        )
        return code, capsys.readouterr().err

    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": pa.array(["fine", None, "x"], type=pa.string())}), nulls)
    code, err = run(val=nulls)
    assert code == 1 and "row 1 has no text" in err and str(nulls) in err

    no_text = tmp_path / "notext.parquet"
    pq.write_table(pa.table({"body": ["a"]}), no_text)
    code, err = run(train=no_text)
    assert code == 1 and "no 'text' column" in err

    empty = write_corpus(tmp_path / "empty.parquet", [])
    code, err = run(val=empty)
    assert code == 1 and "no documents" in err

    code, err = run(train=tmp_path / "missing.parquet")
    assert code == 1 and "missing.parquet does not exist" in err

    bad_tok = tmp_path / "bad.json"
    bad_tok.write_text('{"format": "nanoeuler-bpe", "version": 99}')
    code, err = run(tokenizer=bad_tok)
    assert code == 1 and "bad.json" in err and "version 99" in err

    code, err = run(extra=("--workers", "0"))
    assert code == 1 and "--workers" in err

    assert not out.parent.exists() or list(out.parent.iterdir()) == []
