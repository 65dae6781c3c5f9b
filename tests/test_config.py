"""Config validation: unknown or mistyped keys are one-line errors naming the key; the shipped configs load."""

from __future__ import annotations

import json

import pytest

from nanoeuler import cli
from nanoeuler.config import REPO_ROOT, load_config, load_schema, validate
from nanoeuler.data import alpaca, fineweb, gutenberg
from nanoeuler.data.common import is_remote, local_path
from nanoeuler.errors import UserError

DATA_SECTIONS = ("gutenberg", "fineweb", "alpaca", "corpus")


@pytest.mark.parametrize("config, match", [
    ({"gutenberg": {"idz": [1]}}, r"config key 'gutenberg.idz' is not known \(did you mean 'gutenberg.ids'\?\)"),
    ({"corpus": {"weights": {"books": 1.0}}}, r"config key 'corpus.weights.books' is not known"),
    ({"fineweb": {"byte_budget": 1, "bytebudget": 2}}, r"'fineweb.bytebudget' is not known"),
    ({"gutenbreg": {}}, r"'gutenbreg' is not known \(did you mean 'gutenberg'\?\)"),
])
def test_unknown_key_is_named(config, match):
    with pytest.raises(UserError, match=match):
        validate(config)


@pytest.mark.parametrize("config, match", [
    ({"gutenberg": {"ids": "1342"}}, r"'gutenberg.ids' must be array, got str '1342'"),
    ({"gutenberg": {"ids": [1342, "11"]}}, r"'gutenberg.ids\[1\]' must be integer, got str '11'"),
    ({"gutenberg": {"ids": [0]}}, r"'gutenberg.ids\[0\]' must be >= 1"),
    ({"gutenberg": {"skip_bad": "yes"}}, r"'gutenberg.skip_bad' must be boolean"),
    ({"fineweb": {"byte_budget": 1.5e9}}, r"'fineweb.byte_budget' must be integer, got float"),
    ({"fineweb": {"min_language_score": 2}}, r"'fineweb.min_language_score' must be <= 1"),
    ({"alpaca": {"max_records": 0}}, r"'alpaca.max_records' must be >= 1"),
    ({"alpaca": {"url": 5}}, r"'alpaca.url' must be string, got int"),
    ({"corpus": {"val_fraction": 0}}, r"'corpus.val_fraction' must be > 0"),
    ({"corpus": {"weights": {"fineweb": -1}}}, r"'corpus.weights.fineweb' must be >= 0"),
    ({"corpus": {"weights": [1, 2]}}, r"'corpus.weights' must be object"),
])
def test_wrong_type_or_range_is_named(config, match):
    with pytest.raises(UserError, match=match):
        validate(config)


def test_defaults_are_the_full_run():
    cfg = validate({})
    assert len(cfg["gutenberg"]["ids"]) >= 90 and 100 in cfg["gutenberg"]["ids"]
    assert len(set(cfg["gutenberg"]["ids"])) == len(cfg["gutenberg"]["ids"])
    assert cfg["gutenberg"]["url_template"] == "https://www.gutenberg.org/cache/epub/{id}/pg{id}.txt"
    assert fineweb.sources(cfg["fineweb"])[0] == (
        "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/000_00000.parquet")
    assert cfg["fineweb"]["byte_budget"] == 10**9
    assert alpaca.sources(cfg["alpaca"]) == [
        "https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json"]
    assert validate({"corpus": {"weights": {"fineweb": 0.5}}})["corpus"]["weights"] == {"gutenberg": 1.0,
                                                                                       "fineweb": 0.5}


def _walk(schema, key):
    yield key, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{key}.{name}")


@pytest.mark.parametrize("section", DATA_SECTIONS)
def test_every_data_key_has_a_description_and_a_default(section):
    schema = load_schema()["properties"][section]
    assert schema.get("additionalProperties") is False
    for key, sub in _walk(schema, section):
        assert sub.get("description"), f"{key} has no description"
        if sub.get("type") != "object":
            assert "default" in sub, f"{key} has no default"


@pytest.mark.parametrize("name", ["config", "small", "tiny"])
def test_shipped_configs_validate(name):
    cfg = load_config(REPO_ROOT / "config" / f"{name}.yaml")
    assert set(DATA_SECTIONS) <= set(cfg)


def test_tiny_config_is_offline_and_its_sample_files_exist():
    cfg = load_config(REPO_ROOT / "config" / "tiny.yaml")
    sources = (gutenberg.sources(cfg["gutenberg"]) + fineweb.sources(cfg["fineweb"])
               + alpaca.sources(cfg["alpaca"]))
    assert sources and not any(is_remote(s) for s in sources)
    for s in sources:
        assert local_path(s, REPO_ROOT).is_file(), s


def test_sample_folder_stays_small():
    total = sum(p.stat().st_size for p in (REPO_ROOT / "data" / "sample").rglob("*") if p.is_file())
    assert total < 1_000_000


def test_bad_config_file_names_the_file_and_key(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("alpaca:\n  max_record: 3\n")
    with pytest.raises(UserError, match=r"my\.yaml: config key 'alpaca.max_record' is not known"):
        load_config(path)


def test_stage_cli_rejects_a_bad_key_in_one_line(capsys):
    assert cli.main(["corpus", "--params", json.dumps({"corpus": {"val_frac": 0.1}})]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("nanoeuler corpus: error: config key 'corpus.val_frac' is not known "
                   "(did you mean 'corpus.val_fraction'?)")
