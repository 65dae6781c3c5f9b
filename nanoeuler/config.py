"""Configuration: one YAML file, one schema, defaults for every key.

The schema (`workflow/schemas/config.schema.yaml`) is a small subset of JSON Schema:
`type`, `properties`, `additionalProperties: false`, `default`, `description`, `enum`,
`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `items` (and `$schema`). Every key has a
default and a description. Numbers are finite and integers fit in 64 bits, whatever the schema says.
`validate` fills the defaults in and turns every problem into one line naming the key:

    >>> validate({"alpaca": {"min_outptu": 1}})      # doctest: +SKIP
    UserError: config key 'alpaca.min_outptu' is not known (did you mean 'alpaca.min_output'?)

Snakemake validates the whole config in the Snakefile with this module and hands each stage its
section as JSON (`--params`), so Snakemake re-runs exactly the stages whose section changed. Run by
hand, a stage reads a config file instead (`--config config/tiny.yaml`).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import math
import operator
from pathlib import Path
from typing import Any

import yaml

from nanoeuler.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"

# The keywords `_check` implements; a schema using any other would be silently half-checked.
KEYWORDS = frozenset(
    {
        "$schema",
        "type",
        "properties",
        "additionalProperties",
        "default",
        "description",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "items",
    }
)
INT64 = (-(2**63), 2**63 - 1)  # every integer goes on to NumPy or DuckDB as a 64-bit integer
_BOUNDS = {
    "minimum": (operator.ge, ">="),
    "maximum": (operator.le, "<="),
    "exclusiveMinimum": (operator.gt, ">"),
    "exclusiveMaximum": (operator.lt, "<"),
}

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def load_schema() -> dict:
    if not SCHEMA_PATH.exists():
        raise UserError(f"config schema not found at {SCHEMA_PATH} (run nanoeuler from a clone of the repository)")
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _type_ok(value: Any, type_name: str) -> bool:
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[type_name])


def _check(value: Any, schema: dict, key: str) -> Any:
    """Validate `value` against `schema`, returning it with defaults filled in."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_type_ok(value, t) for t in types):
            raise UserError(
                f"config key '{key}' must be {' or '.join(types)}, got {type(value).__name__} {_show(value)}"
            )
    if "enum" in schema and value not in schema["enum"]:
        raise UserError(f"config key '{key}' must be one of {schema['enum']}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_number(value, schema, key)
    if isinstance(value, list) and "items" in schema:
        return [_check(item, schema["items"], f"{key}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        if schema.get("additionalProperties", True) is False:
            for name in value:
                if name not in props:
                    near = difflib.get_close_matches(str(name), list(props), n=1)
                    hint = f" (did you mean '{_join(key, near[0])}'?)" if near else ""
                    raise UserError(f"config key '{_join(key, name)}' is not known{hint}")
        out = {}
        for name, sub in props.items():
            if name in value:
                out[name] = _check(value[name], sub, _join(key, name))
            elif "default" in sub:
                out[name] = _check(copy.deepcopy(sub["default"]), sub, _join(key, name))
            elif sub.get("type") == "object":
                out[name] = _check({}, sub, _join(key, name))
        for name in value:  # keys allowed by additionalProperties
            out.setdefault(name, value[name])
        return out
    return value


def _check_number(value: int | float, schema: dict, key: str) -> None:
    """A number is finite, an integer fits in 64 bits, and both lie within the schema's bounds."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key '{key}' must be a finite number, got {value}")
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        raise UserError(f"config key '{key}' must be between -2**63 and 2**63-1, got {_show(value)}")
    for word, (ok, sign) in _BOUNDS.items():
        if word in schema and not ok(value, schema[word]):
            raise UserError(f"config key '{key}' must be {sign} {schema[word]}, got {_show(value)}")


def _show(value: Any) -> str:
    """A value as an error shows it: short, and a huge integer by its size (Python prints none of over 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _join(prefix: str, name: str) -> str:
    name = str(name)
    if not name.isprintable():  # a key with a newline or a control character still names itself on one line
        name = name.encode("unicode_escape").decode("ascii")
    return f"{prefix}.{name}" if prefix else name


def validate(config: dict | None, schema: dict | None = None) -> dict:
    """Return a copy of `config` checked against the schema, with every default filled in."""
    return _check(config or {}, schema or load_schema(), "")


def load_config(path: str | Path | None) -> dict:
    """Read a YAML config file (None: all defaults) and validate it."""
    if path is None:
        return validate({})
    from nanoeuler.files import SMALL_JSON, read_text

    path = Path(path)
    text = read_text(path, "config file", SMALL_JSON)  # bounded: a device or FIFO is refused
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except ValueError as exc:  # a value YAML cannot build: a date of month 13, an integer of 5000 digits
        raise UserError(f"config file {path} holds a value that cannot be read: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise UserError(f"config file {path} is nested too deeply to read") from None
    if raw is not None and not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    try:
        return validate(raw)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The two ways a stage gets its settings: a config file, or its section as JSON (from Snakemake)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--config", metavar="YAML", help="config file (default: all defaults)")
    group.add_argument("--params", metavar="JSON", help="this stage's config sections as JSON (Snakemake passes this)")


def sections(args: argparse.Namespace, *names: str) -> dict[str, dict]:
    """The named config sections for a stage, validated, as {name: section}.

    `--params` holds a JSON object {section_name: section, ...}; missing sections get defaults.
    """
    if getattr(args, "params", None):
        try:
            given = json.loads(args.params)
        except ValueError as exc:  # JSONDecodeError, or an integer of over 4300 digits
            raise UserError(f"--params is not valid JSON: {exc}") from None
        if not isinstance(given, dict):
            raise UserError("--params must be a JSON object of config sections")
        full = validate(given)
    else:
        full = load_config(getattr(args, "config", None))
    return {name: full[name] for name in names}


def params_json(config: dict, *names: str) -> str:
    """The JSON a Snakemake rule passes as `--params` for the given sections (stable key order)."""
    return json.dumps({name: config[name] for name in names}, sort_keys=True, separators=(",", ":"))
