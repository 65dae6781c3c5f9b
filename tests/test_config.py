"""Config validation: unknown or mistyped keys are one-line errors naming the key; the shipped configs load."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoeuler import cli
from nanoeuler.config import KEYWORDS, REPO_ROOT, load_config, load_schema, validate
from nanoeuler.data import alpaca, fineweb, gutenberg
from nanoeuler.data.common import is_remote, local_path
from nanoeuler.errors import UserError

DATA_SECTIONS = ("gutenberg", "fineweb", "alpaca", "corpus")


@pytest.mark.parametrize(
    "config, match",
    [
        ({"gutenberg": {"idz": [1]}}, r"config key 'gutenberg.idz' is not known \(did you mean 'gutenberg.ids'\?\)"),
        ({"corpus": {"weights": {"books": 1.0}}}, r"config key 'corpus.weights.books' is not known"),
        ({"fineweb": {"byte_budget": 1, "bytebudget": 2}}, r"'fineweb.bytebudget' is not known"),
        ({"gutenbreg": {}}, r"'gutenbreg' is not known \(did you mean 'gutenberg'\?\)"),
    ],
)
def test_unknown_key_is_named(config, match):
    with pytest.raises(UserError, match=match):
        validate(config)


@pytest.mark.parametrize(
    "config, match",
    [
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
    ],
)
def test_wrong_type_or_range_is_named(config, match):
    with pytest.raises(UserError, match=match):
        validate(config)


def test_defaults_are_the_full_run():
    cfg = validate({})
    assert len(cfg["gutenberg"]["ids"]) >= 90 and 100 in cfg["gutenberg"]["ids"]
    assert len(set(cfg["gutenberg"]["ids"])) == len(cfg["gutenberg"]["ids"])
    assert cfg["gutenberg"]["url_template"] == "https://www.gutenberg.org/cache/epub/{id}/pg{id}.txt"
    assert fineweb.sources(cfg["fineweb"])[0] == (
        "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/000_00000.parquet"
    )
    assert cfg["fineweb"]["byte_budget"] == 10**9
    assert alpaca.sources(cfg["alpaca"]) == [
        "https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json"
    ]
    assert validate({"corpus": {"weights": {"fineweb": 0.5}}})["corpus"]["weights"] == {
        "gutenberg": 1.0,
        "fineweb": 0.5,
    }


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
    sources = gutenberg.sources(cfg["gutenberg"]) + fineweb.sources(cfg["fineweb"]) + alpaca.sources(cfg["alpaca"])
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
    assert err == (
        "nanoeuler corpus: error: config key 'corpus.val_frac' is not known (did you mean 'corpus.val_fraction'?)"
    )


# ---- numbers: finite, 64-bit, within every bound the schema states --------------------------------


def _numeric_keys(schema, path=()):
    """(path, key schema) of every number or integer key, a list's items as index 0 of a one-item list."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types or []
    if {"number", "integer"} & set(types):
        yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _numeric_keys(sub, (*path, name))
    if "items" in schema:
        yield from _numeric_keys(schema["items"], (*path, 0))


def _config_with(path, value):
    """The smallest config setting `path` (names and list indexes) to `value`."""
    out = value
    for step in reversed(path):
        out = [out] if step == 0 else {step: out}
    return out


def _key_name(path):
    return ".".join(str(p) for p in path).replace(".0", "[0]")


def _is_float_key(sub):
    return "number" in ([sub["type"]] if isinstance(sub["type"], str) else sub["type"])


SCHEMA = load_schema()
FLOAT_KEYS = [(path, sub) for path, sub in _numeric_keys(SCHEMA) if _is_float_key(sub)]
INT_KEYS = [(path, sub) for path, sub in _numeric_keys(SCHEMA) if not _is_float_key(sub)]


def test_the_schema_has_the_numeric_keys_the_tests_walk():
    assert len(FLOAT_KEYS) >= 27 and ("corpus", "val_fraction") in [p for p, _ in FLOAT_KEYS]
    assert ("gutenberg", "ids", 0) in [p for p, _ in INT_KEYS]


def _within(value, sub):
    return (
        value >= sub.get("minimum", value)
        and value <= sub.get("maximum", value)
        and ("exclusiveMinimum" not in sub or value > sub["exclusiveMinimum"])
        and ("exclusiveMaximum" not in sub or value < sub["exclusiveMaximum"])
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(key=st.sampled_from(FLOAT_KEYS), value=st.floats(allow_nan=True, allow_infinity=True) | st.integers())
def test_every_float_key_takes_only_finite_numbers_within_its_bounds(key, value):
    path, sub = key
    try:
        out = validate(_config_with(path, value), SCHEMA)
    except UserError as exc:
        assert str(exc).startswith(f"config key '{_key_name(path)}' must be"), str(exc)
        assert "\n" not in str(exc)
    else:
        got = out
        for step in path:
            got = got[step]
        assert got == value and math.isfinite(value) and _within(value, sub)
        assert not isinstance(value, int) or abs(value) < 2**63


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    key=st.sampled_from(INT_KEYS),
    value=st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.integers(2**63, 2**70)
    | st.integers(-(2**70), -(2**63) - 1)
    | st.just(10**5000),
)
def test_an_integer_key_refuses_floats_bools_and_values_beyond_64_bits(key, value):
    path, _ = key
    with pytest.raises(UserError) as exc:
        validate(_config_with(path, value), SCHEMA)
    assert str(exc.value).startswith(f"config key '{_key_name(path)}' must be"), str(exc.value)
    assert len(str(exc.value)) < 200


@pytest.mark.parametrize(
    "text, match",
    [
        ("corpus:\n  val_fraction: .nan\n", r"'corpus.val_fraction' must be a finite number, got nan"),
        ("pretrain:\n  lr: .inf\n", r"'pretrain.lr' must be a finite number, got inf"),
        ("eval:\n  temperature: -.inf\n", r"'eval.temperature' must be a finite number, got -inf"),
        ("pretrain:\n  steps: .inf\n", r"'pretrain.steps' must be integer, got float inf"),
        ("fineweb:\n  byte_budget: 99999999999999999999\n", r"'fineweb.byte_budget' must be between -2\*\*63"),
        ("gutenberg:\n  delay_s: 1.0e+15\n", r"'gutenberg.delay_s' must be <= 3600, got 1000000000000000.0"),
        ("corpus:\n  weights:\n    fineweb: 1.0e+300\n", r"'corpus.weights.fineweb' must be <= 100"),
        ("dpo:\n  label_smoothing: 0.5\n", r"'dpo.label_smoothing' must be < 0.5, got 0.5"),
        ("corpus:\n  seed: " + "9" * 5000 + "\n", r"holds a value that cannot be read: Exceeds the limit"),
        ("corpus:\n  seed: 2026-13-45\n", r"holds a value that cannot be read: month must be in 1..12"),
    ],
)
def test_a_number_that_is_not_finite_or_too_big_is_one_line_naming_it(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=match) as exc:
        load_config(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_nan_in_params_json_stops_the_stage_before_duckdb(capsys):
    assert cli.main(["corpus", "--params", '{"corpus": {"val_fraction": NaN}}']) == 1
    assert capsys.readouterr().err.strip() == (
        "nanoeuler corpus: error: config key 'corpus.val_fraction' must be a finite number, got nan"
    )


def test_the_schema_uses_only_keywords_the_validator_checks():
    def walk(schema, key):
        assert set(schema) <= KEYWORDS, f"{key or 'the schema'} uses {sorted(set(schema) - KEYWORDS)}"
        for name, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{key}.{name}" if key else name)
        if "items" in schema:
            walk(schema["items"], f"{key}[]")

    walk(SCHEMA, "")
