"""Byte-level BPE: the worked example, merge learning against a naive reference, encode/decode,
special tokens, the file format, the `nanoeuler tokenizer` stage, and parity with tiktoken."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoeuler import cli
from nanoeuler.errors import UserError
from nanoeuler.tokenizer.bpe import EOT, END, GPT2_PATTERN, MAX_VOCAB, Tokenizer, count_chunks, split_gpt2, train_bpe

# Varied text: prose, code, numbers, whitespace runs, emoji, CJK, combining marks, other scripts.
SAMPLES = [
    "The quick brown fox jumps over the lazy dog. It's what they'd've done, isn't it?",
    "In 1887, the river rose 3.5 metres; by 2024 nobody remembered. Call 555-0100 or +44 20 7946 0958.",
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # circle\n\n\n"
    "if __name__ == '__main__':\n\tprint(area(2))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot product\r\n",
    "   leading spaces, trailing spaces   \n\n\n    indented\t\ttabs \x0b\x0c and\r\n\r\nCRLF  ",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 and ❤️",
    "CJK: 東京は日本の首都です。中文也可以。한국어 텍스트.",
    "combining: e\u0301 a\u0308 n\u0303 \u1e9b\u0323 Zalgo z\u0351\u0352\u0353 café naïve coöperate",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ไทย",
    "numbers ² ³ ½ Ⅷ ١٢٣ ۴۵۶ 0x1F 1e-9 1_000_000 12345678901234567890",
    "odd spaces:\u00a0nbsp\u2009thin\u3000ideographic\u2028line\u2029para\x85nel end",
    "quotes ‘single’ “double” — dashes – and … ellipsis; 'quoted' \"double\" `tick`",
    "",
    " ",
    "\n",
    "a",
    "'s 're 've 'm 'll 'd 'S 'RE",
]

_WORDS = (
    "the of and to in a is that it was for on with as he she they we you be at by this had not but from "
    "or have an which one were all their there been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three river morning rain"
).split()


def _prose(n_sentences: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2025)))
        out.append(" ".join(words) + rng.choice([".", ".", ",", "?", "!", ";"]))
    return " ".join(out)


TRAIN_TEXT = "\n\n".join(
    [
        _prose(400),
        "It was a bright cold day in April, and the clocks were striking thirteen. The river was low; "
        "the boats waited at the quay, and they'd talked about the weather and the price of coal.",
        "def tokenize(text):\n    chunks = pattern.findall(text)\n    return [merge(c) for c in chunks]\n",
        "Results: 12 of 40 runs failed (30.0%), 28 passed; mean time 4.25 s, median 3.9 s, max 17 s.",
        "東京 大阪 京都 東京 東京 こんにちは 世界 こんにちは",
        "café café naïve naïve résumé 😀 😀 👍🏽",
    ]
    * 2
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(TRAIN_TEXT, vocab_size=600)


# ---- the worked example --------------------------------------------------------------------------


def test_worked_example_merge_sequence():
    # "aaabdaaabac": pairs aa x4 (overlapping), ab x2 -> merge a+a = 256: [256] a b d [256] a b a c.
    # Now (256, a) and (a, b) both occur twice; the tie goes to the smaller pair of ids, (97, 98) = 257:
    # [256] [257] d [256] [257] a c. Then (256, 257) occurs twice and becomes 258.
    tok = train_bpe("aaabdaaabac", vocab_size=256 + 3 + 2)
    assert tok.merges == [(97, 97), (97, 98), (256, 257)]
    assert [tok.token_bytes(i) for i in (256, 257, 258)] == [b"aa", b"ab", b"aaab"]
    assert tok.encode("aaabdaaabac") == [258, 100, 258, 97, 99]
    assert tok.special_tokens == {EOT: 259, END: 260}
    assert tok.vocab_size == 261


def test_tie_break_prefers_smaller_ids():
    # chunks "ab" and " cd": the pairs (a,b), (space,c), (c,d) all occur once; (32, 99) has the smallest ids
    assert train_bpe("ab cd", vocab_size=256 + 1 + 2).merges == [(32, 99)]


def test_pretokenization_keeps_merges_inside_chunks():
    # "a1" is two chunks (letters, digits), so the pair (a, 1) never forms even though it is frequent
    tok = train_bpe("a1 " * 50, vocab_size=256 + 20 + 2)
    assert (ord("a"), ord("1")) not in tok.merges
    assert regex.findall(GPT2_PATTERN, " hello world's  end") == [" hello", " world", "'s", " ", " end"]


# ---- merge learning against a naive reference ------------------------------------------------------


def naive_train(text: str, n_merges: int) -> list[tuple[int, int]]:
    """Full recount per merge; highest count, then smallest (left, right) ids; never a duplicate token."""
    words = Counter(tuple(c.encode("utf-8")) for c in regex.findall(GPT2_PATTERN, text))
    vocab = [bytes([i]) for i in range(256)]
    merges = []
    while len(merges) < n_merges:
        counts = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                counts[p] += c
        known = set(vocab)
        cands = [(-c, p) for p, c in counts.items() if vocab[p[0]] + vocab[p[1]] not in known]
        if not cands:
            break
        a, b = min(cands)[1]
        new = len(vocab)
        vocab.append(vocab[a] + vocab[b])
        merges.append((a, b))
        merged = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return merges


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="aab bc'\n é東", max_size=80), st.integers(1, 30))
def test_incremental_training_matches_naive_reference(text, n_merges):
    if not text:
        return
    tok = train_bpe(text, vocab_size=256 + n_merges + 2)
    expected = naive_train(text, n_merges)
    assert tok.merges == expected


def test_incremental_training_matches_naive_reference_on_real_text():
    assert train_bpe(TRAIN_TEXT[:3000], vocab_size=256 + 120 + 2).merges == naive_train(TRAIN_TEXT[:3000], 120)


def test_token_bytes_are_unique():
    # "aaaa..." invites (a,a) then (aa,a) and (a,aa), which would make "aaa" twice; we never merge a duplicate
    tok = train_bpe(["a" * n for n in range(1, 12)] * 3 + ["ba aab aaab"], vocab_size=256 + 40 + 2)
    seen = [tok.token_bytes(i) for i in range(256 + len(tok.merges))]
    assert len(set(seen)) == len(seen)


def test_runs_out_of_pairs_with_a_warning(capsys):
    tok = train_bpe("abc", vocab_size=300)
    assert tok.merges == [(97, 98), (256, 99)]
    assert tok.vocab_size == 256 + 2 + 2
    assert "only supports 2 merges" in capsys.readouterr().err


def test_deterministic():
    a = train_bpe(TRAIN_TEXT, vocab_size=500).to_json()
    b = train_bpe(TRAIN_TEXT, vocab_size=500).to_json()
    c = train_bpe(count_chunks(TRAIN_TEXT), vocab_size=500).to_json()
    assert a == b == c


# ---- bounds and empty input ---------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [0, 256, 257, MAX_VOCAB + 1, 100_000])
def test_vocab_size_out_of_bounds(vocab_size):
    with pytest.raises(UserError, match="vocab_size"):
        train_bpe("some text", vocab_size=vocab_size)


def test_smallest_vocab_has_no_merges():
    tok = train_bpe("some text", vocab_size=258)
    assert tok.merges == [] and tok.vocab_size == 258
    assert tok.decode(tok.encode("héllo")) == "héllo"


@pytest.mark.parametrize("corpus", ["", [], ["", ""], Counter()])
def test_empty_corpus(corpus):
    with pytest.raises(UserError, match="empty"):
        train_bpe(corpus, vocab_size=300)


# ---- encode / decode -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8")))
def test_round_trip_arbitrary_unicode(tok, s):
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert tok.decode_bytes(ids) == s.encode("utf-8")
    assert all(0 <= i < 256 + len(tok.merges) for i in ids)


@pytest.mark.parametrize("s", SAMPLES)
def test_round_trip_samples(tok, s):
    assert tok.decode(tok.encode(s)) == s
    assert tok.decode(tok.encode(s, allowed_special="all")) == s


ALPHABET = "ab Z09_'\t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u2009\u3000é東😀\u0301²Ⅷ-.,"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=ALPHABET, max_size=60))
def test_fast_split_equals_the_gpt2_pattern(s):
    assert split_gpt2(s) == regex.findall(GPT2_PATTERN, s)


@pytest.mark.parametrize("s", SAMPLES + [TRAIN_TEXT])
def test_fast_split_equals_the_gpt2_pattern_on_samples(s):
    assert split_gpt2(s) == regex.findall(GPT2_PATTERN, s)


def test_compresses_frequent_words(tok):
    assert tok.encode(" the river") == [tok.encode(" the")[0], tok.encode(" river")[0]]
    assert tok.encode("東京") == list("東京".encode("utf-8"))  # too rare here to earn a merge


def test_decode_partial_utf8_gives_replacement_characters(tok):
    ids = tok.encode("é😀")
    raw = "é😀".encode("utf-8")
    assert tok.decode_bytes(ids) == raw
    assert tok.decode([raw[0]]) == "\ufffd"  # first byte of é alone
    assert tok.decode(list(raw[:4])) == "é\ufffd"  # é, then a cut-off emoji
    assert tok.decode([]) == "" and tok.decode_bytes([]) == b""


def test_decode_rejects_unknown_ids(tok):
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode([1, bad])


def test_decode_accepts_numpy_arrays(tok):
    np = pytest.importorskip("numpy")
    ids = tok.encode("numpy ids")
    assert tok.decode(np.array(ids, dtype=np.uint16)) == "numpy ids"


def test_encode_batch(tok):
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]


def test_small_cache_gives_the_same_ids(tok):
    small = Tokenizer(tok.merges, pattern=tok.pattern, cache_size=3)
    for s in SAMPLES + [TRAIN_TEXT]:
        assert small.encode(s) == tok.encode(s)


# ---- special tokens ----------------------------------------------------------------------------------------


def test_special_ids_follow_the_merges(tok):
    assert tok.eot_id == 256 + len(tok.merges)
    assert tok.end_id == tok.eot_id + 1
    assert tok.vocab_size == tok.end_id + 1 == 600


def test_specials_are_plain_text_unless_allowed(tok):
    s = "one<|endoftext|>two</s>"
    plain = tok.encode(s)
    assert tok.eot_id not in plain and tok.end_id not in plain
    assert plain == tok.encode(s, allowed_special="none") == tok.encode(s, allowed_special=set())
    assert tok.decode(plain) == s

    both = tok.encode(s, allowed_special="all")
    assert both == tok.encode("one") + [tok.eot_id] + tok.encode("two") + [tok.end_id]
    assert tok.decode(both) == s

    only_end = tok.encode(s, allowed_special={END})
    assert tok.end_id in only_end and tok.eot_id not in only_end
    assert tok.decode(only_end) == s


def test_special_edge_cases(tok):
    assert tok.encode("<|endoftext|><|endoftext|>", allowed_special="all") == [tok.eot_id] * 2
    assert tok.encode("</s", allowed_special="all") == tok.encode("</s")
    assert tok.decode([tok.eot_id]) == EOT
    with pytest.raises(ValueError, match="unknown special"):
        tok.encode("x", allowed_special={"<|im_start|>"})
    with pytest.raises(ValueError, match="allowed_special"):
        tok.encode("x", allowed_special="some")


# ---- file format -----------------------------------------------------------------------------------------


def test_save_load_round_trip(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    again = Tokenizer.load(path)
    assert again.to_json() == tok.to_json() == path.read_text(encoding="utf-8")
    assert again.merges == tok.merges and again.special_tokens == tok.special_tokens
    import hashlib

    assert tok.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    d = json.loads(path.read_text())
    assert d["format"] == "nanoeuler-bpe" and d["version"] == 1 and d["pattern"] == GPT2_PATTERN
    assert d["merges"][0] == list(tok.merges[0]) and d["vocab_size"] == 600
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp files left


def _corrupt(tok, **change):
    d = json.loads(tok.to_json())
    d.update(change)
    return json.dumps(d)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: _corrupt(t, version=2), "version 2 is not supported"),
        (lambda t: _corrupt(t, format="something"), "not a nanoeuler tokenizer"),
        (lambda t: t.to_json()[: len(t.to_json()) // 2], "not valid JSON"),
        (lambda t: "", "not valid JSON"),
        (lambda t: _corrupt(t, merges=[[1, 2], [3]]), "'merges'"),
        (
            lambda t: _corrupt(t, merges=[[1, 2], [1, 9999]], special_tokens={EOT: 258, END: 259}, vocab_size=260),
            "'merges'",
        ),
        (lambda t: _corrupt(t, special_tokens={EOT: 5, END: 6}), "special token ids"),
        (lambda t: _corrupt(t, special_tokens={EOT: 600}), "special token ids"),
        (lambda t: _corrupt(t, pattern="(unclosed"), "'pattern'"),
        (lambda t: _corrupt(t, vocab_size=601), "vocab_size"),
    ],
)
def test_load_rejects_bad_files(tok, tmp_path, edit, message):
    path = tmp_path / "bad.json"
    path.write_text(edit(tok), encoding="utf-8")
    with pytest.raises(UserError, match=message) as info:
        Tokenizer.load(path)
    assert str(path) in str(info.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope.json")


def test_load_missing_required_special(tok):
    d = json.loads(tok.to_json())
    d["special_tokens"] = {EOT: tok.eot_id}
    with pytest.raises(UserError, match="'</s>' is missing"):
        Tokenizer.from_json(json.dumps(d))


# ---- the `nanoeuler tokenizer` stage -------------------------------------------------------------------------


def _write_corpus(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"source": ["test"] * len(texts), "doc_id": [str(i) for i in range(len(texts))], "text": texts})
    pq.write_table(table, path)


def test_stage_writes_identical_files(tmp_path):
    corpus = tmp_path / "train.parquet"
    _write_corpus(corpus, TRAIN_TEXT.split("\n\n") + SAMPLES)
    params = json.dumps({"tokenizer": {"vocab_size": 400, "sample_bytes": 2000, "seed": 3}})
    outs = []
    for run in ("a", "b"):
        out, hf = tmp_path / run / "tokenizer.json", tmp_path / run / "tokenizer.hf.json"
        assert (
            cli.main(["tokenizer", "--params", params, "--corpus", str(corpus), "--out", str(out), "--hf-out", str(hf)])
            == 0
        )
        outs.append((out.read_bytes(), hf.read_bytes()))
        tok = Tokenizer.load(out)
        assert tok.vocab_size == 400
        assert tok.decode(tok.encode(TRAIN_TEXT)) == TRAIN_TEXT
    assert outs[0] == outs[1]


def test_stage_sample_depends_on_seed_and_size():
    from nanoeuler.tokenizer.train import sample_texts

    texts = [f"document {i} " * (i + 1) for i in range(50)]
    a = sample_texts(texts, 500, seed=0)
    assert sum(len(t.encode()) for t in a) == 500
    assert a == sample_texts(texts, 500, seed=0) != sample_texts(texts, 500, seed=1)
    assert sample_texts(texts, 10**9, seed=0) == texts
    cut = sample_texts(["é" * 10], 5, seed=0)  # cut inside a character: drop the half
    assert cut == ["é" * 2]


def test_stage_sample_streams_the_corpus_file(tmp_path):
    """The stage reads the sample from the parquet file in two passes (sizes, then the picked texts), with
    the same documents, order and cut as sampling the whole column in memory; a null text is named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanoeuler.tokenizer.train import read_texts, sample_corpus, sample_texts

    texts = [f"doc {i} é " * (1 + i % 7) for i in range(20000)]  # several parquet batches
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=3000)
    for budget in (100, 77_777, 10**9):
        assert sample_corpus(path, budget, seed=3) == sample_texts(read_texts(path), budget, seed=3)
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match="row 1 has no text"):
        sample_corpus(tmp_path / "bad.parquet", 10, seed=0)


def test_stage_errors(tmp_path, capsys):
    out = tmp_path / "tokenizer.json"
    assert cli.main(["tokenizer", "--corpus", str(tmp_path / "none.parquet"), "--out", str(out)]) == 1
    assert "none.parquet does not exist" in capsys.readouterr().err

    empty = tmp_path / "empty.parquet"
    _write_corpus(empty, ["", ""])
    assert cli.main(["tokenizer", "--corpus", str(empty), "--out", str(out)]) == 1
    assert "no text" in capsys.readouterr().err

    notparquet = tmp_path / "bad.parquet"
    notparquet.write_text("not parquet")
    assert cli.main(["tokenizer", "--corpus", str(notparquet), "--out", str(out)]) == 1
    assert "not a readable parquet file" in capsys.readouterr().err

    bad_vocab = json.dumps({"tokenizer": {"vocab_size": 100}})
    assert cli.main(["tokenizer", "--params", bad_vocab, "--corpus", str(empty), "--out", str(out)]) == 1
    assert "tokenizer.vocab_size" in capsys.readouterr().err
    assert not out.exists()


# ---- tiktoken as an oracle for encoding ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiktoken_enc(tok):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {tok.token_bytes(i): i for i in range(256 + len(tok.merges))}
    return tiktoken.Encoding(
        "nanoeuler-test", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=tok.special_tokens
    )


@pytest.mark.parametrize("s", SAMPLES + [TRAIN_TEXT])
def test_same_ids_as_tiktoken(tok, tiktoken_enc, s):
    assert tok.encode(s) == tiktoken_enc.encode_ordinary(s)
    assert tok.encode(s + EOT + s, allowed_special="all") == tiktoken_enc.encode(s + EOT + s, allowed_special="all")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.text(alphabet=ALPHABET, max_size=60))
def test_same_ids_as_tiktoken_on_generated_text(tok, tiktoken_enc, s):
    assert tok.encode(s) == tiktoken_enc.encode_ordinary(s)


def test_docstring_examples():
    import doctest

    from nanoeuler.tokenizer import bpe

    assert doctest.testmod(bpe).failed == 0
