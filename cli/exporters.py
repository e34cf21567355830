"""``shardckpt export``: a shardckpt checkpoint out to a foreign format (``dcp``, ``deepspeed``,
``hf``), one command per exporter of :data:`shardckpt.tools.exporters.EXPORTERS`, the twin of
the ``import`` commands (:mod:`.importers`).

Thin: each command's arguments and help come from its exporter and the fields of its config
(:mod:`shardckpt.interop.exporter` says how a field is spelled); one body
(:func:`_run_export`) parses them, runs the export, and prints one line or JSON of what it
wrote. Errors become one line on stderr and a non-zero exit (``guarded``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any
from collections.abc import Callable

import typer

from .app import app
from .common import StorageOptionArg, echo_json, guarded, human_bytes, parse_bytes, parse_storage_options

export_app = typer.Typer(help="Export a shardckpt checkpoint to a foreign format.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(export_app, name="export")


def _flag(f: dataclasses.Field[Any]) -> str:
    """The command-line spelling of config field ``f``."""
    return str(f.metadata.get("flag", "--" + f.name.replace("_", "-")))


def _fields(exporter: Any) -> list[dataclasses.Field[Any]]:
    """The fields of the exporter's config that the command line sets (those with a help)."""
    return [f for f in dataclasses.fields(exporter.Config) if "help" in f.metadata]


def _option(f: dataclasses.Field[Any]) -> inspect.Parameter:
    """A typer option for config field ``f``: a byte count is text (``32MB``), a field without a
    default a required option, None an optional value, anything else a value with its default."""
    default: Any = f.default
    if "bytes" in f.metadata:
        annotation: Any = str
        default = f.metadata["bytes"]
    elif default is dataclasses.MISSING:
        annotation, default = f.type, ...
    elif default is None:
        annotation = str | None
    else:
        annotation = type(default)
    if isinstance(annotation, str):  # a postponed annotation: the field's type by name
        annotation = {"int": int, "str": str, "bool": bool, "float": float}[annotation]
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, _flag(f), help=f.metadata["help"]))


def _parameters(exporter: Any) -> list[inspect.Parameter]:
    """The arguments and options of ``shardckpt export <exporter.name>``."""
    def param(name: str, annotation: Any, default: Any) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                 default=default)

    return [
        param("src", str, typer.Argument(..., help=exporter.source_help)),
        param("dst", str, typer.Argument(..., help=exporter.destination_help)),
        *(_option(f) for f in _fields(exporter)),
        param("storage_option", list[str] | None, StorageOptionArg),
        param("json_out", bool, typer.Option(False, "--json", help="Print a JSON summary.")),
    ]


def _run_export(exporter: Any, args: dict[str, Any]) -> None:
    """``shardckpt export <exporter.name>``: the options parsed (a bad size is exit code 2),
    the export run, one line or JSON."""
    from .common import progress
    from shardckpt.interop.exporter import ExportOptions, run_exporter

    opts = parse_storage_options(args["storage_option"])
    config = {f.name: parse_bytes(args[f.name], _flag(f)) if "bytes" in f.metadata else args[f.name]
              for f in _fields(exporter)}
    options = ExportOptions(args["src"], args["dst"], opts, opts, exporter.Config(**config))
    summary = run_exporter(exporter, options, progress)
    if args["json_out"]:
        echo_json(summary)
    else:
        typer.echo(exporter.summary_line(summary, options, human_bytes))


def _export_command(exporter: Any) -> Callable[..., None]:
    """The command of one exporter: its parameters (:func:`_parameters`), its help, and
    :func:`_run_export` as the body."""
    def command(**args: Any) -> None:
        _run_export(exporter, args)

    command.__name__ = command.__qualname__ = f"export_{exporter.name}_command"
    command.__doc__ = exporter.help
    command.__signature__ = inspect.Signature(_parameters(exporter))  # type: ignore[attr-defined]
    return command


def _register_exporters() -> None:
    from shardckpt.tools.exporters import EXPORTERS, get_exporter

    for name in EXPORTERS:
        export_app.command(name)(guarded(_export_command(get_exporter(name))))


_register_exporters()
