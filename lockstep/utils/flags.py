"""Option dataclasses that are their own command line (ServerArgs, the router's RouterConfig):
each field is a flag, --its-name, typed by its annotation (`int | None` -> int, `list[str]` ->
any number of values; a bool gets --no-... too), with its help, --help group, choices, other
names taking the same value and flags that set a fixed value in the field's metadata (`flag`)."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence
from dataclasses import field, fields
from typing import Any, TypeVar

T = TypeVar("T")


def flag(default: Any, help: str, group: str, *, choices: Sequence[str] | None = None,
         names: Sequence[str] = (), aliases: dict[str, Any] | None = None, min: float | None = None,
         secret: bool = False) -> Any:
    """A field and its command-line flag: help text, --help group, choices, other names of the
    flag (another server's spelling, taking the same value; not for booleans), other flags that
    set it to a fixed value (SGLang's spellings), the least value accepted (None always is), and
    whether it is a secret that must never be shown."""
    metadata = {"help": help, "group": group, "choices": choices, "names": tuple(names),
                "aliases": aliases or {}, "min": min, "secret": secret}
    if isinstance(default, list):  # a mutable default: every instance gets its own copy
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls`, filed under its group in --help."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in fields(cls):
        meta = f.metadata
        if (group := groups.get(meta["group"])) is None:
            group = groups[meta["group"]] = parser.add_argument_group(f"{meta['group']} options")
        name = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        kind = next((k for k in typing.get_args(hint) if k is not type(None)), hint)
        names = (name, *meta["names"])
        if kind is bool:
            if meta["names"]:
                raise TypeError(f"{f.name}: a boolean flag takes no other names (its --no- form would double)")
            group.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=meta["help"])
        elif typing.get_origin(hint) is list:
            group.add_argument(*names, dest=f.name, nargs="*", type=kind, default=[], help=meta["help"])
        else:
            shown = "" if f.default is None else f" (default: {f.default})"
            group.add_argument(*names, dest=f.name, type=kind, default=f.default, choices=meta["choices"],
                               help=meta["help"] + shown)
        for alias, value in meta["aliases"].items():
            same = name if value is True else f"--no-{name[2:]}" if value is False else (
                f"{name} {value}")
            group.add_argument(alias, dest=f.name, action="store_const", const=value,
                               help=f"Same as {same} (SGLang's name).")


def from_flags(parser: argparse.ArgumentParser, cls: type[T], ns: argparse.Namespace) -> T:
    """`cls` from the parsed flags; a ValueError of its own checks exits as argparse's do."""
    try:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})  # type: ignore[arg-type]
    except ValueError as e:
        parser.error(str(e))


def below_min(options: Any) -> list[str]:
    """What is wrong with `options`: each field under the least value its flag accepts."""
    return [f"--{f.name.replace('_', '-')} must be >= {f.metadata['min']}"
            for f in fields(options) if f.metadata["min"] is not None
            and getattr(options, f.name) is not None
            and getattr(options, f.name) < f.metadata["min"]]
