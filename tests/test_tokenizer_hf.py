"""The HF `tokenizers` export: the library loads it and gives our ids and our text back."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoeuler.tokenizer.bpe import EOT, END, Tokenizer, train_bpe
from nanoeuler.tokenizer.hf import bytes_to_unicode, to_hf_json
from test_bpe import ALPHABET, SAMPLES, TRAIN_TEXT

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(TRAIN_TEXT, vocab_size=600)


@pytest.fixture(scope="module")
def hf(tok):
    return tokenizers.Tokenizer.from_str(to_hf_json(tok))


def test_byte_table_is_gpt2s():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0] == "Ā"
    assert all(not c.isspace() and c.isprintable() for c in table.values())


def test_export_structure(tok):
    d = json.loads(to_hf_json(tok))
    assert d["model"]["type"] == "BPE" and len(d["model"]["merges"]) == len(tok.merges)
    assert len(d["model"]["vocab"]) == 256 + len(tok.merges)
    assert d["pre_tokenizer"] == {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    assert {t["content"]: t["id"] for t in d["added_tokens"]} == tok.special_tokens
    assert to_hf_json(tok) == to_hf_json(Tokenizer.from_json(tok.to_json()))  # deterministic


def test_vocab_size_matches(tok, hf):
    assert hf.get_vocab_size(with_added_tokens=True) == tok.vocab_size
    assert hf.token_to_id(EOT) == tok.eot_id and hf.token_to_id(END) == tok.end_id


@pytest.mark.parametrize("s", SAMPLES + [TRAIN_TEXT])
def test_same_ids_and_text(tok, hf, s):
    ids = tok.encode(s)
    assert hf.encode(s, add_special_tokens=False).ids == ids
    assert hf.decode(ids) == s


def test_special_tokens(tok, hf):
    s = "first document<|endoftext|>second</s> third"
    ids = tok.encode(s, allowed_special="all")
    assert hf.encode(s).ids == ids
    assert ids.count(tok.eot_id) == 1 and ids.count(tok.end_id) == 1
    assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids) == s


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.text(alphabet=ALPHABET, max_size=60))
def test_same_ids_on_generated_text(tok, hf, s):
    if EOT in s or END in s:  # HF always matches added tokens; ours only when allowed
        return
    assert hf.encode(s).ids == tok.encode(s)


def test_other_split_pattern_exports_a_split_pre_tokenizer(hf):
    pattern = r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+"  # digits one by one
    tok = train_bpe(TRAIN_TEXT, vocab_size=400, pattern=pattern)
    other = tokenizers.Tokenizer.from_str(to_hf_json(tok))
    for s in SAMPLES:
        assert other.encode(s).ids == tok.encode(s)


def test_stage_output_loads_from_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanoeuler import cli

    corpus = tmp_path / "train.parquet"
    pq.write_table(pa.table({"source": ["t"], "doc_id": ["0"], "text": [TRAIN_TEXT]}), corpus)
    out, hf_out = tmp_path / "tokenizer.json", tmp_path / "tokenizer.hf.json"
    params = json.dumps({"tokenizer": {"vocab_size": 300}})
    assert (
        cli.main(["tokenizer", "--params", params, "--corpus", str(corpus), "--out", str(out), "--hf-out", str(hf_out)])
        == 0
    )
    ours, theirs = Tokenizer.load(out), tokenizers.Tokenizer.from_file(str(hf_out))
    for s in SAMPLES:
        assert theirs.encode(s).ids == ours.encode(s)
