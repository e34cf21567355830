"""Commands generated from a registry: ``shardckpt import <format>`` and ``shardckpt export
<format>`` get one command each per registered importer or exporter, whose options are the
fields of its config dataclass (those with a ``help`` in their metadata).

How a config field is spelled: its metadata's ``flag`` (else the caller's table, else
``--field-name``); a byte count (metadata ``bytes``: its default as text) is text such as
``32MB``; a tuple default a repeatable option; a field without a default a required option;
None an optional value; anything else a value with its default.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any
from collections.abc import Callable, Iterable, Mapping

import typer

from .common import guarded, parse_bytes

#: Postponed annotations of config fields without a default: the type by name.
_TYPES = {"int": int, "str": str, "bool": bool, "float": float}


def keyword(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    """A keyword parameter of a generated command (``default``: a typer Argument or Option)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=default)


def config_fields(config: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``config`` the command line sets (those with a help)."""
    return [f for f in dataclasses.fields(config) if "help" in f.metadata]


def config_flag(f: dataclasses.Field[Any], flags: Mapping[str, str] | None = None) -> str:
    """The command-line spelling of config field ``f`` (module docstring)."""
    return str(f.metadata.get("flag") or (flags or {}).get(f.name) or "--" + f.name.replace("_", "-"))


def config_option(f: dataclasses.Field[Any], flag: str) -> inspect.Parameter:
    """A typer option for config field ``f`` spelled ``flag`` (module docstring)."""
    default: Any = f.default
    if "bytes" in f.metadata:
        annotation: Any = str
        default = f.metadata["bytes"]
    elif isinstance(default, tuple):
        annotation, default = list[str] | None, None
    elif default is dataclasses.MISSING:
        annotation, default = f.type, ...
    elif default is None:
        annotation = str | None
    else:
        annotation = type(default)
    if isinstance(annotation, str):
        annotation = _TYPES[annotation]
    return keyword(f.name, annotation, typer.Option(default, flag, help=f.metadata["help"]))


def config_values(fields: Iterable[dataclasses.Field[Any]], args: Mapping[str, Any],
                  flag: Callable[[dataclasses.Field[Any]], str]) -> dict[str, Any]:
    """The config's keyword arguments from a command's ``args``: byte counts parsed (a bad one
    is exit code 2), repeated options a tuple."""
    out: dict[str, Any] = {}
    for f in fields:
        value = args[f.name]
        if "bytes" in f.metadata:
            value = parse_bytes(value, flag(f))
        elif isinstance(f.default, tuple):
            value = tuple(value or ())
        out[f.name] = value
    return out


def add_commands(group: typer.Typer, verb: str, items: Iterable[Any],
                 parameters: Callable[[Any], list[inspect.Parameter]],
                 run: Callable[[Any, dict[str, Any]], None]) -> None:
    """One command of ``group`` per item (an importer or exporter: its ``name`` and ``help``),
    with ``parameters(item)`` as its signature and ``run(item, args)`` as its body; errors
    become one line on stderr and a non-zero exit (``guarded``)."""
    for item in items:
        group.command(item.name)(guarded(_command(verb, item, parameters(item), run)))


def _command(verb: str, item: Any, params: list[inspect.Parameter],
             run: Callable[[Any, dict[str, Any]], None]) -> Callable[..., None]:
    def command(**args: Any) -> None:
        run(item, args)

    command.__name__ = command.__qualname__ = f"{verb}_{item.name}_command"
    command.__module__ = run.__module__  # the command is its body's module's (cli/run.py's table)
    command.__doc__ = item.help
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return command
