"""Configuration: one YAML file, one schema, defaults for every key.

The schema (`workflow/schemas/config.schema.yaml`) is a small subset of JSON Schema:
`type`, `properties`, `additionalProperties: false`, `default`, `description`, `enum`,
`minimum`, `maximum`, `exclusiveMinimum`, `items`. Every key has a default and a description.
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
from pathlib import Path
from typing import Any

import yaml

from nanoeuler.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"

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
            raise UserError(f"config key '{key}' must be {' or '.join(types)}, got {type(value).__name__} {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise UserError(f"config key '{key}' must be one of {schema['enum']}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise UserError(f"config key '{key}' must be >= {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            raise UserError(f"config key '{key}' must be <= {schema['maximum']}, got {value}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise UserError(f"config key '{key}' must be > {schema['exclusiveMinimum']}, got {value}")
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
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise UserError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"config file {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
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
        except json.JSONDecodeError as exc:
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
