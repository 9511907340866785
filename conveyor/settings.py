"""Settings dataclasses are the one source of their settings: each field, declared with
``setting``, makes a command-line flag (``--max-num-seqs``, its help, choices and default), a
keyword of the constructor (``LLM(max_num_seqs=...)``), and a flag again when a process starts
another with the same settings (a data-parallel replica). Validation is the dataclass's own, at
construction, wherever the values come from."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def setting(default: Any, help: str, *, choices: tuple | None = None,
            short: str | None = None, metavar: str | None = None, repeat: bool = False) -> Any:
    """A dataclass field that is also a command-line flag (``--field-name``, and ``short``).
    repeat: a list's flag may be given again, each time adding to the list (``--x A --x B``)
    where otherwise the last one says."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "short": short, "metavar": metavar, "repeat": repeat})


class DefaultsHelp(argparse.HelpFormatter):
    """Each flag's help with its default, where the help does not say it (settings' flags do)
    and there is one to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(cls: type, name: str) -> tuple[type, bool]:
    """The field's type without ``None`` (a union of int and str parses as str), and whether it
    is a list."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] \
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
    if len(args) == 1 and typing.get_origin(args[0]) is list:
        return typing.get_args(args[0])[0], True
    return (args[0] if len(args) == 1 else str), False


def add_arguments(parser: argparse._ActionsContainer, cls: type,
                  only: tuple[str, ...] | None = None) -> None:
    """A flag for every field of the settings dataclass ``cls`` (or those named ``only``),
    default shown in the help."""
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        meta = f.metadata
        names = [flag(f.name)] + ([meta["short"]] if meta.get("short") else [])
        shown = "" if f.default is None else f" (default: {f.default})"
        kind, many = _base_type(cls, f.name)
        if kind is bool:
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            parser.add_argument(*names, dest=f.name, default=f.default, action=action,
                                help=meta["help"] + shown)
            continue
        parser.add_argument(*names, dest=f.name, default=f.default, type=kind,
                            nargs="+" if many else None, choices=meta.get("choices"),
                            action="extend" if many and meta.get("repeat") else "store",
                            metavar=meta.get("metavar"), help=meta["help"] + shown)


def check_choices(settings: Any) -> None:
    """Raises ValueError for a field outside its choices (None stays allowed where it is the
    default)."""
    for f in dataclasses.fields(settings):
        choices, value = f.metadata.get("choices"), getattr(settings, f.name)
        unset = value is None and f.default is None
        if choices is not None and value not in choices and not unset:
            raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")


def from_namespace(cls: type, args: argparse.Namespace) -> Any:
    """The settings ``cls`` from parsed flags (validated by its construction)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def to_flags(settings: Any) -> list[str]:
    """Flags that give another process these settings: each value that is not the default."""
    out = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            out.append(flag(f.name) if value else "--no-" + flag(f.name)[2:])
        elif isinstance(value, list):
            out += [flag(f.name), *map(str, value)]
        else:
            out += [flag(f.name), str(value)]
    return out
