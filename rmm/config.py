"""One way to configure every command: a YAML file of a dataclass's fields, then `key=value` overrides.

`load_config(Schema, path, ["epochs=2", "batching.max_batch=8"])` reads the file, sets each dotted
key on it (values parsed as YAML, so `lora=true`, `eval_ks=[5, 10]` and `lr=3e-4` are typed), and
builds `Schema` with pydantic's validation: stdlib dataclasses (nested ones are sections), checked
and coerced against their type hints (ranges as `Annotated[int, Field(ge=1)]`: "must be >= 1"), with
unknown keys refused. Every mistake is one `rmm.errors.ConfigError` naming the key and where it
came from (the file or the overrides), because a typo silently falling back to a default would
waste a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rmm.errors import ConfigError

__all__ = ["ConfigError", "load_config", "parse_overrides", "read_yaml", "set_dotted"]

T = TypeVar("T")

# pydantic error types → what the value should have been
_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "list_type": "a list", "dict_type": "a mapping", "dataclass_type": "a mapping",
    "none_required": "null",
}
# pydantic's bound errors (a field's `Field(ge=…, gt=…, le=…, lt=…)`) → the comparison and its context key
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def load_config(schema: type[T], path: str | Path | None = None,
                overrides: Sequence[str] | Mapping[str, Any] = (), *, label: str = "config") -> T:
    """`schema` (a dataclass) from the YAML file at `path` (defaults when None), then `overrides`.

    `overrides` are `key=value` strings (command lines) or a mapping of dotted keys to values
    already typed (flags); either way they win over the file. `label` names the config in errors
    ("pretraining config", "server config").
    """
    data = read_yaml(path, label) if path is not None else {}
    items = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides)
    for key, value in items.items():
        set_dotted(data, key, value)
    origin = _Origin(path, set(items))
    return _validate(schema, data, origin)


def read_yaml(path: str | Path, label: str = "config") -> dict[str, Any]:
    """The mapping at the top of a YAML file; a clear error if it is unreadable, invalid or not a mapping."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"cannot read {label} {file}: it does not exist")
    try:
        loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {label} {file}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{label} {file} is not valid YAML: {_one_line(exc)}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{label} {file} must be a mapping at the top level, got {type(loaded).__name__}")
    return loaded


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """`["epochs=2", "learner.lr=3e-4"]` → `{"epochs": 2, "learner.lr": 0.0003}` (values read as YAML).

    Leading dashes and dashes in names are forgiven (`--max-steps=5` is `max_steps=5`)."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            parsed[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: cannot parse the value: {_one_line(exc)}") from exc
    return parsed


def _one_line(error: Exception) -> str:
    """PyYAML's multi-line message (problem, context, position) as one line."""
    return " ".join(str(error).split())


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """`data["a"]["b"] = value` for `"a.b"`, creating sections on the way."""
    *parents, leaf = dotted.split(".")
    target = data
    for part in parents:
        child = target.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted}: {part} is not a section")
        target = child
    target[leaf] = value


@dataclasses.dataclass(frozen=True)
class _Origin:
    """Where the values came from, to say in an error which one to fix."""

    path: str | Path | None
    overridden: set[str]

    def of(self, key: str) -> str:
        if any(key == o or key.startswith((o + ".", o + "[")) for o in self.overridden):
            return "the overrides"
        return str(self.path) if self.path is not None else "the defaults"

    def describe(self) -> str:
        sources = ([str(self.path)] if self.path is not None else []) + (["the overrides"] if self.overridden else [])
        return "from " + (" and ".join(sources) or "the defaults")


@functools.cache
def _root_model(schema: type) -> Any:
    """A pydantic model with one field of type `schema`; its config (unknown keys forbidden, numbers
    accepted for strings) is inherited by the dataclass and every section nested in it."""
    from pydantic import ConfigDict, create_model

    return create_model(f"{schema.__name__}Config", __config__=ConfigDict(extra="forbid", coerce_numbers_to_str=True),
                        value=(schema, ...))


def _validate(schema: type[T], data: dict[str, Any], origin: _Origin) -> T:
    from pydantic import ValidationError

    try:
        return _root_model(schema).model_validate({"value": data}).value
    except ValidationError as exc:
        raise _config_error(schema, exc.errors(), origin) from None


def _config_error(schema: type, errors: list[Any], origin: _Origin) -> ConfigError:
    """One error for all of pydantic's, each naming the dotted key and where it came from."""
    unknown: dict[str, list[str]] = {}  # where → keys
    known: dict[str, list[str]] = {}  # where → valid keys at those keys' levels
    problems: dict[str, list[str]] = {}  # key → what it should have been
    got: dict[str, Any] = {}
    for error in errors:
        key, section = _walk(schema, error["loc"][1:])
        if error["type"] == "value_error":  # the schema's own check (`__post_init__`) names its key
            return ConfigError(f"{key + ': ' if key else ''}{error['ctx']['error']} ({origin.describe()})")
        if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            where = origin.of(key)
            unknown.setdefault(where, []).append(key)
            prefix = key.rpartition(".")[0]
            names = [f.name for f in dataclasses.fields(section)] if section else []
            known.setdefault(where, []).extend(f"{prefix}.{n}" if prefix else n for n in names)
            continue
        ctx = error.get("ctx") or {}
        if error["type"] == "literal_error":
            expected = f"one of {ctx['expected']}"
        elif error["type"] in _BOUNDS:
            sign, bound = _BOUNDS[error["type"]]
            value = ctx[bound]  # pydantic casts a float field's bound to float: 0 reads as 0, not 0.0
            expected = f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}"
        else:
            expected = _EXPECTED.get(error["type"], error["msg"][0].lower() + error["msg"][1:])
        problems.setdefault(key, []).append(expected)
        got.setdefault(key, error.get("input"))
    messages = []
    for where, keys in unknown.items():
        valid = list(dict.fromkeys(known[where]))
        close = [m for k in sorted(keys) for m in difflib.get_close_matches(k, valid, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        messages.append(f"unknown setting(s) {sorted(keys)} in {where}{hint}; known: {valid}")
    for key, expected in problems.items():
        messages.append(f"{key or 'config'} must be {' or '.join(dict.fromkeys(expected))}, got {got[key]!r} "
                        f"(in {origin.of(key)})")
    return ConfigError("; ".join(messages))


def _walk(schema: type, loc: Sequence[str | int]) -> tuple[str, type | None]:
    """pydantic's error location → the dotted key (`batching.max_batch`, `eval_ks[1]`) and the
    dataclass that holds its last part. Union-member tags in the location are skipped."""
    parts: list[str] = []
    current: type | None = schema
    holder: type | None = schema
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif current is not None:  # past a leaf, parts are union members' tags ("int", "str")
            holder = current
            parts.append(f".{part}" if parts else part)
            known = {f.name for f in dataclasses.fields(current)}
            current = _section(typing.get_type_hints(current)[part]) if part in known else None
    return "".join(parts), holder


def _section(hint: Any) -> type | None:
    """The dataclass a field holds (also inside `X | None`), if any."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a) and isinstance(a, type)), None)
    return None
