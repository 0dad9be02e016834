"""`--config FILE [key=value …]` for commands whose settings are their flags (`rmm train`, `rmm eval`).

The schema is made from the command's own flags: a key is a flag's name with underscores
(`update_every`), its value is checked by the flag's own argument type (the same ranges and
messages as on the command line), and its default is the flag's. So a config file and the flags
can never drift apart, and a flag added to a command is a config key at once.

Precedence: built-in defaults < the config file < key=value overrides < flags given explicitly.
The file and the overrides go through `rmm.config.load_config` (unknown keys, bad types and
out-of-range values are one `ConfigError` naming the key and the file), right after parsing, so
the parser reports them as its one `error:` line (exit 2) before any work starts.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from rmm.cli.arguments import CheckedParser, add_check, non_negative_int

__all__ = ["PRECEDENCE", "add_config_options"]

PRECEDENCE = ("Settings: built-in defaults < --config FILE < key=value overrides < flags given on the command "
              "line. Keys are the flags' names with underscores (e.g. per_user: true, batch_size: 128).")

# Not settings: how to read the settings, and argparse's own.
_NOT_SETTINGS = {"config", "overrides", "help"}


@dataclasses.dataclass(frozen=True)
class _Setting:
    """One flag as a config key: its name, its default, and how a value from a file is checked."""

    name: str
    default: Any
    check: Callable[[Any], Any]


def add_config_options(parser: argparse.ArgumentParser, label: str, example: str) -> None:
    """Add `--config FILE` and `key=value` overrides to `parser`; call it after every other flag.

    Every flag's default moves into the settings schema (the parser keeps `SUPPRESS`, so a flag
    present in the namespace was given explicitly and wins over the file). `label` names the
    settings in errors ("training config"); `example` is a shipped config for the help text.
    """
    if not isinstance(parser, CheckedParser):
        raise TypeError("--config needs an rmm CheckedParser, which fills the settings in after parsing")
    settings = _Settings(parser.prog, label, [_setting(action) for action in parser._actions
                                              if action.dest not in _NOT_SETTINGS and action.option_strings])
    for action in parser._actions:
        if action.dest in settings.names:
            action.default = argparse.SUPPRESS
    parser.add_argument("--config", metavar="FILE", help=f"YAML file of settings, e.g. {example}")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="settings over the file's (values read as YAML: per_user=true); put them before "
                             "any flag that takes several values, or after --")
    parser.overrides = "overrides"
    add_check(parser, settings.resolve, first=True)


class _Settings:
    """A command's flags as config keys, and how to settle their effective values after parsing."""

    def __init__(self, prog: str, label: str, settings: list[_Setting]) -> None:
        self.prog, self.label, self.settings = prog, label, settings
        self.names = [s.name for s in settings]

    @functools.cached_property
    def schema(self) -> type:
        """The dataclass `rmm.config.load_config` validates against, one field per flag; built at
        parse time, not when the parser is, so `rmm --help` never imports pydantic."""
        from typing import Annotated

        from pydantic import BeforeValidator

        fields = [(s.name, Annotated[Any, BeforeValidator(s.check)],
                   dataclasses.field(default_factory=functools.partial(copy.deepcopy, s.default)))
                  for s in self.settings]
        name = "".join(part.title() for part in self.prog.replace("-", " ").split()) + "Settings"
        return dataclasses.make_dataclass(name, fields)

    def resolve(self, args: argparse.Namespace) -> str | None:
        """Fill `args` with the effective settings (defaults < file < overrides < explicit flags);
        a problem with the file or the overrides is the message the parser reports."""
        from rmm.config import load_config
        from rmm.errors import ConfigError

        explicit = {name: getattr(args, name) for name in self.names if hasattr(args, name)}
        for name, value in explicit.items():  # `--retriever bm25 k=5`: the flag took the override
            stray = [item for item in value if isinstance(item, str) and item.partition("=")[0] in self.names
                     and "=" in item] if isinstance(value, list) else []
            if stray:
                return (f"--{name.replace('_', '-')} took {stray[0]!r} as one of its values: put key=value "
                        "overrides before flags that take several values, or after --")
        try:
            loaded = load_config(self.schema, args.config, args.overrides, label=self.label)
        except ConfigError as error:
            return str(error)
        for name in self.names:
            setattr(args, name, explicit[name] if name in explicit else getattr(loaded, name))
        return None


def _setting(action: argparse.Action) -> _Setting:
    """A flag → a setting whose values a file may give as YAML types or strings."""
    default = action.default
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return _Setting(action.dest, default, _flag)
    if isinstance(action, argparse._CountAction):
        return _Setting(action.dest, default or 0, _nullable(_one(non_negative_int, None), default))
    if type(action) is not argparse._StoreAction:
        raise TypeError(f"--config cannot hold {action.option_strings[0]} ({type(action).__name__})")
    one = _one(action.type or str, action.choices)
    if action.nargs in ("+", "*"):
        return _Setting(action.dest, default, _nullable(_many(one, empty_ok=action.nargs == "*"), default))
    if action.nargs is not None:
        raise TypeError(f"--config cannot hold {action.option_strings[0]} (nargs={action.nargs!r})")
    return _Setting(action.dest, default, _nullable(one, default))


def _one(convert: Callable[[str], Any], choices: Any) -> Callable[[Any], Any]:
    """A scalar checked as the command line checks it: its text through the flag's type, then its choices."""

    def check(value: Any) -> Any:
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected a single value, got {value!r}")  # noqa: TRY004 (pydantic reports ValueErrors)
        text = value if isinstance(value, str) else str(value)
        try:
            converted = convert(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            message = str(error).replace(repr(text), repr(value)) or f"invalid value {value!r}"
            raise ValueError(message) from None
        if choices is not None and converted not in choices:
            raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {value!r}")
        return converted

    return check


def _many(one: Callable[[Any], Any], empty_ok: bool) -> Callable[[Any], Any]:
    """A list (a single value counts as a list of one), each item checked like the flag's values."""

    def check(value: Any) -> list[Any]:
        items = value if isinstance(value, list) else [value]
        if not items and not empty_ok:
            raise ValueError("expected at least one value, got []")
        return [one(item) for item in items]

    return check


def _nullable(check: Callable[[Any], Any], default: Any) -> Callable[[Any], Any]:
    """null is the flag left unset: allowed where that is the default (None), refused elsewhere."""

    def checked(value: Any) -> Any:
        if value is None:
            if default is None:
                return None
            raise ValueError(f"cannot be null; leave the key out for its default ({default!r})")
        return check(value)

    return checked


def _flag(value: Any) -> bool:
    """An on/off flag (`--per-user`) is true or false in a file, nothing else."""
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")  # noqa: TRY004 (pydantic reports ValueErrors)
    return value
