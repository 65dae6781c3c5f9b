"""Properties of the parsers a user can feed, checked by hypothesis on generated input.

Each reader either returns a result or raises UserError with one line, whatever the bytes: never
another exception, never a traceback. The checkpoint reader also never returns a model other than
the one written, and the tokenizer gives back every string it encodes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nanoeuler import checkpoint
from nanoeuler.errors import UserError

EXAMPLES = 150
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def one_line(exc: UserError) -> None:
    text = str(exc)
    assert text and "\n" not in text and "Traceback" not in text


# ---- config loader -------------------------------------------------------------------------------

SECTIONS = [
    "device",
    "gutenberg",
    "fineweb",
    "alpaca",
    "corpus",
    "tokenizer",
    "shards",
    "model",
    "pretrain",
    "sft",
    "eval",
]
KEYS = [
    "ids",
    "url",
    "retries",
    "timeout_s",
    "max_time_s",
    "weights",
    "vocab_size",
    "dim",
    "ctx_len",
    "steps",
    "lr",
    "batch_size",
    "preset",
    "chat_prompts",
    "temperature",
    "gutenberg",
    "fineweb",
    "val_fraction",
]
scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=True) | st.text(max_size=12)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
configs = st.dictionaries(
    st.sampled_from(SECTIONS) | st.text(max_size=8) | st.integers(0, 3),
    st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), values, max_size=4) | values,
    max_size=4,
)


@pytest.fixture(scope="module")
def schema():
    from nanoeuler.config import load_schema

    return load_schema()


@SETTINGS
@given(config=configs)
def test_config_validation_accepts_or_names_the_key(schema, config):
    from nanoeuler.config import validate

    try:
        out = validate(config, schema)
    except UserError as exc:
        one_line(exc)
        assert "config key" in str(exc)
    else:
        assert set(SECTIONS) <= set(out)


@SETTINGS
@given(
    data=st.binary(max_size=300)
    | st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass"))
    | st.sampled_from([b"[" * 100_000, b"a: &x [*x]", b"\xff\xfe"])
)
def test_config_files_of_any_bytes(tmp_path, data):
    from nanoeuler.config import load_config

    path = tmp_path / "c.yaml"
    path.write_bytes(data)
    try:
        load_config(path)
    except UserError as exc:
        one_line(exc)


# ---- Alpaca JSON and the SFT JSON-lines reader ---------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
records = (
    st.fixed_dictionaries(
        {},
        optional={
            "instruction": json_values | st.text(),
            "input": json_values | st.text(),
            "output": json_values | st.text(),
        },
    )
    | json_values
)


@SETTINGS
@given(
    data=st.lists(records, max_size=8).map(json.dumps).map(str.encode)
    | st.binary(max_size=200)
    | st.sampled_from([b"[" * 100_000, b"[{" * 50_000, b"\xef\xbb\xbf[]", b"null"])
)
def test_alpaca_reader_and_cleaner(tmp_path, data):
    from nanoeuler.data import alpaca

    path = tmp_path / "alpaca_data.json"
    path.write_bytes(data)
    try:
        kept, counts = alpaca.clean(alpaca.load_records(path), source=str(path))
    except UserError as exc:
        one_line(exc)
    else:
        assert counts["written"] == len(kept) > 0
        assert all(set(r) == set(alpaca.FIELDS) and all(isinstance(v, str) for v in r.values()) for r in kept)


@SETTINGS
@given(
    lines=st.lists(
        records.map(json.dumps).map(str.encode) | st.binary(max_size=40) | st.just(b"[" * 100_000), max_size=6
    )
)
def test_sft_jsonl_reader(tmp_path, lines):
    from nanoeuler.train.sft import read_records

    path = tmp_path / "alpaca.jsonl"
    path.write_bytes(b"\n".join(lines))
    try:
        got = read_records(path)
    except UserError as exc:
        one_line(exc)
    else:
        assert got and all(isinstance(r["instruction"], str) and isinstance(r["output"], str) for r in got)


@SETTINGS
@given(
    data=st.binary(max_size=200)
    | st.dictionaries(st.text(max_size=6), json_values, max_size=4).map(json.dumps).map(str.encode)
)
def test_shard_manifest_and_metrics_readers(tmp_path, data):
    from nanoeuler.train.loader import read_manifest
    from nanoeuler.train.rundir import read_jsonl

    path = tmp_path / "manifest.json"
    path.write_bytes(data)
    try:
        assert "splits" in read_manifest(path)
    except UserError as exc:
        one_line(exc)
    (tmp_path / "metrics.jsonl").write_bytes(data + b"\n" + data)
    assert all(isinstance(r, dict) for r in read_jsonl(tmp_path / "metrics.jsonl"))


# ---- checkpoint reader: byte flips ----------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "c.bin"
    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "b": np.arange(5, dtype=np.int64),
        "h": rng.standard_normal(6).astype(np.float16),
    }
    meta = {"step": 12, "model_config": {"dim": 4, "n_layers": 1}, "tokenizer": '{"merges": [[1, 2]]}'}
    checkpoint.save(path, tensors, meta)
    return path.read_bytes(), tensors, meta


@SETTINGS
@given(data=st.data())
def test_a_flipped_checkpoint_is_refused_or_means_the_same(saved, tmp_path, data):
    raw, tensors, meta = saved
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), min_size=1, max_size=3))
    blob = bytearray(raw)
    for at, mask in flips:
        blob[at] ^= mask
    assume(bytes(blob) != raw)
    path = tmp_path / "c.bin"
    path.write_bytes(bytes(blob))
    try:
        got, got_meta = checkpoint.load(path)
    except UserError as exc:
        one_line(exc)
        return
    # only bytes that change nothing may be flipped without a refusal (header padding, say)
    assert got_meta == meta and list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].tobytes() == t.tobytes()


@SETTINGS
@given(cut=st.integers(0, 10**6))
def test_a_truncated_checkpoint_is_refused(saved, tmp_path, cut):
    raw = saved[0]
    path = tmp_path / "c.bin"
    path.write_bytes(raw[: cut % len(raw)])
    with pytest.raises(UserError) as err:
        checkpoint.load(path)
    one_line(err.value)


# ---- tokenizer round trip -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from train_fixtures import make_tokenizer

    return make_tokenizer()


@SETTINGS
@given(
    text=st.text(max_size=60)
    | st.text(st.characters(codec="utf-8"), max_size=60)
    | st.sampled_from(["<|endoftext|>", "</s>", "a</s>b", "\r\n\t", "🙂" * 5, "ǅ" * 3])
)
def test_tokenizer_round_trip_on_any_unicode(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.end_id not in ids and tok.eot_id not in ids  # special-token text in user input stays text


@SETTINGS
@given(text=st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3))
def test_lone_surrogates_are_refused_in_one_line(text):
    from nanoeuler.errors import check_text

    with pytest.raises(UserError) as err:
        check_text("ok " + text, "--prompt")
    one_line(err.value)
