"""``shardckpt export``: a shardckpt checkpoint out to a foreign format (``dcp``, ``deepspeed``,
``hf``), one command per exporter of :data:`shardckpt.tools.exporters.EXPORTERS`, the twin of
the ``import`` commands (:mod:`.importers`).

Thin: each command's arguments and help come from its exporter and the fields of its config
(:mod:`shardckpt.interop.exporter` says how a field is spelled); one body
(:func:`_run_export`, registered by :func:`.generated.add_commands`) parses them, runs the
export, and prints one line or JSON of what it wrote. Errors become one line on stderr and a non-zero exit (``guarded``).
"""

from __future__ import annotations

import inspect
from typing import Any

import typer

from .app import app
from .common import StorageOptionArg, echo_json, human_bytes, parse_storage_options
from .generated import add_commands, config_fields, config_flag, config_option, config_values, keyword

export_app = typer.Typer(help="Export a shardckpt checkpoint to a foreign format.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(export_app, name="export")


def _parameters(exporter: Any) -> list[inspect.Parameter]:
    """The arguments and options of ``shardckpt export <exporter.name>``."""
    return [
        keyword("src", str, typer.Argument(..., help=exporter.source_help)),
        keyword("dst", str, typer.Argument(..., help=exporter.destination_help)),
        *(config_option(f, config_flag(f)) for f in config_fields(exporter.Config)),
        keyword("storage_option", list[str] | None, StorageOptionArg),
        keyword("json_out", bool, typer.Option(False, "--json", help="Print a JSON summary.")),
    ]


def _run_export(exporter: Any, args: dict[str, Any]) -> None:
    """``shardckpt export <exporter.name>``: the options parsed (a bad size is exit code 2),
    the export run, one line or JSON."""
    from .common import progress
    from shardckpt.interop.exporter import ExportOptions, run_exporter

    opts = parse_storage_options(args["storage_option"])
    config = config_values(config_fields(exporter.Config), args, config_flag)
    options = ExportOptions(args["src"], args["dst"], opts, opts, exporter.Config(**config))
    summary = run_exporter(exporter, options, progress)
    if args["json_out"]:
        echo_json(summary)
    else:
        typer.echo(exporter.summary_line(summary, options, human_bytes))


def _register_exporters() -> None:
    from shardckpt.tools.exporters import EXPORTERS, get_exporter

    add_commands(export_app, "export", (get_exporter(n) for n in EXPORTERS), _parameters, _run_export)


_register_exporters()
