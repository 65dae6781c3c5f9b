"""`nanoeuler prefs`: the three real layouts, multi-turn prompts, and every kind of bad record."""

import gzip
import json
import subprocess
import sys

import pytest

from nanoeuler.data import prefs
from nanoeuler.errors import UserError

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def hh(*turns):
    roles = ["Human", "Assistant"] * len(turns)
    return "".join(f"\n\n{r}: {t}" for r, t in zip(roles, turns))


def test_hh_multi_turn_becomes_instruction_and_history():
    rec = {
        "chosen": hh("Hi", "Hello!", "Name a colour.", "Blue."),
        "rejected": hh("Hi", "Hello!", "Name a colour.", "No."),
    }
    pair = prefs.to_pair(*prefs.parse_hh(rec))
    assert pair["prompt"].endswith(
        "### Instruction:\nName a colour.\n\n### Input:\nHuman: Hi\nAssistant: Hello!\n\n### Response:\n"
    )
    assert (pair["chosen"], pair["rejected"]) == ("Blue.", "No.")


def test_a_system_message_is_named_in_the_history():
    sg = {
        "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a colour."}],
        "chosen": {"from": "gpt", "value": "Blue."},
        "rejected": {"from": "gpt", "value": "No."},
    }
    assert "### Input:\nSystem: Be brief.\n\n" in prefs.to_pair(*prefs.parse_sharegpt(sg))["prompt"]


def test_hh_answers_sharing_their_first_words_keep_them():
    rec = {"chosen": hh("Name a colour.", "Blue is one."), "rejected": hh("Name a colour.", "Blue? No.")}
    assert prefs.to_pair(*prefs.parse_hh(rec))["rejected"] == "Blue? No."


def test_ultrafeedback_and_sharegpt_give_the_same_pair_as_hh():
    hh_rec = {
        "chosen": hh("Hi", "Hello!", "Name a colour.", "Blue."),
        "rejected": hh("Hi", "Hello!", "Name a colour.", "No."),
    }
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
    ]
    uf = {
        "prompt": "Name a colour.",
        "chosen": msgs + [{"role": "assistant", "content": "Blue."}],
        "rejected": msgs + [{"role": "assistant", "content": "No."}],
    }
    sg = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Name a colour."},
        ],
        "chosen": {"from": "gpt", "value": "Blue."},
        "rejected": {"from": "gpt", "value": "No."},
    }
    want = prefs.to_pair(*prefs.parse_hh(hh_rec))
    assert prefs.to_pair(*prefs.parse_ultrafeedback(uf)) == want
    assert prefs.to_pair(*prefs.parse_sharegpt(sg)) == want


def test_every_unusable_pair_is_counted_by_number():
    good = {"chosen": hh("Q?", "Yes."), "rejected": hh("Q?", "No.")}
    records = [
        good,
        {"chosen": hh("Q?", "Same."), "rejected": hh("Q?", "Same.")},  # 2 chosen == rejected
        {"chosen": hh("Q?", "Yes."), "rejected": hh("Q?", "   ")},  # 3 empty response
        {"chosen": hh("A?", "x", "Q?", "Yes."), "rejected": hh("B?", "x", "Q?", "No.")},  # 4 parted early
        dict(good),  # 5 repeat
        {"chosen": hh("R?", "Yes."), "rejected": hh("R?", "No.")},
    ]
    pairs, bad = prefs.clean(records, "hh")
    assert len(pairs) == 2
    assert {k: v for k, v in bad.items() if v} == {"same": [2], "empty": [3], "no_prompt": [4], "duplicate": [5]}
    assert "chosen == rejected 1: #2" in prefs.summary(bad, 6, 2)


def test_malformed_records_are_all_named_in_one_error_or_skipped():
    records = [
        {"chosen": hh("Q?", "Yes."), "rejected": hh("Q?", "No.")},
        {"chosen": "x"},
        [1],
        {"chosen": 1, "rejected": "y"},
    ]
    with pytest.raises(
        UserError,
        match=r"3 of 4 records are malformed .*#2 missing 'rejected'; "
        r"#3 is a list.*#4 'chosen' is int",
    ):
        prefs.clean(records, "hh", source="f.jsonl")
    pairs, bad = prefs.clean(records, "hh", skip_bad=True)
    assert len(pairs) == 1 and bad["malformed"] == [2, 3, 4]
    with pytest.raises(UserError, match="'conversations' must be a list of"):
        prefs.clean([{"conversations": [{"from": "human"}], "chosen": {}, "rejected": {}}], "sharegpt")


def test_no_usable_pair_is_an_error():
    with pytest.raises(UserError, match="no usable preference pair"):
        prefs.clean([{"chosen": hh("Q?", "A."), "rejected": hh("Q?", "A.")}], "hh")


@pytest.mark.parametrize(
    "fmt,name,written", [("hh", "hh_train.jsonl.gz", 46), ("ultrafeedback", "ultrafeedback_train_prefs.parquet", 46)]
)
def test_cli_on_the_sample_fixtures(tmp_path, fmt, name, written):
    params = {"prefs": {"format": fmt, "url": f"data/sample/prefs/{name}", "delay_s": 0}}
    out = tmp_path / "prefs.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoeuler",
            "prefs",
            "--params",
            json.dumps(params),
            "--out",
            str(out),
            "--raw-dir",
            str(tmp_path / "raw"),
            "--source-root",
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == written and all(set(r) == {"prompt", "chosen", "rejected"} for r in rows)
    assert f"{written} pairs" in proc.stderr and "chosen == rejected 1" in proc.stderr


def test_cli_bad_inputs_end_with_one_line_and_no_output(tmp_path):
    bad_gz = tmp_path / "train.jsonl.gz"
    bad_gz.write_bytes(gzip.compress(b'{"chosen": "x"}\n')[:-6])  # truncated
    parquet = tmp_path / "uf.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["q"], "chosen": [[{"role": "user", "content": "q"}]]}), parquet)
    for fmt, src, want in (("hh", bad_gz, "truncated gzip"), ("ultrafeedback", parquet, "lacks column(s) rejected")):
        params = {"prefs": {"format": fmt, "url": str(src), "delay_s": 0}}
        out = tmp_path / f"{fmt}.jsonl"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "nanoeuler",
                "prefs",
                "--params",
                json.dumps(params),
                "--out",
                str(out),
                "--raw-dir",
                str(tmp_path / f"raw_{fmt}"),
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 1
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("nanoeuler prefs: error:") and want in last, proc.stderr
        assert not out.exists()
