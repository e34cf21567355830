"""``shardckpt import``: foreign checkpoints into the shardckpt format (``hf``, ``deepspeed``,
``dcp``). Its twin, ``shardckpt export``, is :mod:`.exporters`.

Thin: parse options, call the importer, print one line or JSON of what it wrote.
Errors become one line on stderr and a non-zero exit (``guarded``). The ``import`` commands are
one body (:func:`_run_import`, registered by :func:`.generated.add_commands`) for every importer of :data:`shardckpt.interop.importer.IMPORTERS`:
each command's arguments and help come from its importer and the fields of its config.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any
from collections.abc import Callable

import typer

from .app import app
from .common import (
    EXIT_USAGE, StorageOptionArg, echo_json, fail, human_bytes, parse_bytes, parse_storage_options,
)
from .generated import add_commands, config_fields, config_flag, config_option, config_values, keyword


#: Common options of :class:`shardckpt.interop.importer.ImportOptions` -> their flags.
_FLAGS = {"ranks": "--ranks", "replicate": "--replicate", "units": "--unit",
          "buffer_bytes": "--buffer", "storage_options": "--storage-option"}


def _flag(field: str) -> str:
    """The command-line spelling of an import option (common, or of an importer's config)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _config_flag(f: dataclasses.Field[Any]) -> str:
    return config_flag(f, _FLAGS)


def _report(m: Any, dst: str, importer: Any, json_out: bool,
            line: Callable[[dict[str, Any]], str]) -> None:
    """What an import wrote (:func:`shardckpt.interop.importing.import_summary`): JSON, or the
    line ``line`` makes of it."""
    from shardckpt.interop.importing import import_summary

    summary = import_summary(m, dst, importer.summary)
    if json_out:
        echo_json(summary)
    else:
        typer.echo(line(summary))


import_app = typer.Typer(help="Import a foreign checkpoint as a shardckpt checkpoint.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(import_app, name="import")


def _import_parameters(importer: Any) -> list[inspect.Parameter]:
    """The arguments and options of ``shardckpt import <importer.name>``."""
    param = keyword
    needs_ranks = importer.ranks_help is None
    ranks = (param("ranks", int, typer.Option(..., "--ranks", help="World size the checkpoint is "
                                                                   "laid out for."))
             if needs_ranks else
             param("ranks", int | None, typer.Option(None, "--ranks", help=importer.ranks_help)))
    unit_help = (("R" if needs_ranks else "With --ranks: r") + "egular expression whose match "
                 "(whole name components) is one unit (repeatable). Default: "
                 + " ".join(importer.default_units) + " (one unit per block).")
    return [
        param("src", str, typer.Argument(..., help=importer.source_help)),
        param("dst", str, typer.Argument(..., help="Checkpoint to create (path or fsspec URL).")),
        ranks,
        param("replicate", int, typer.Option(1, "--replicate", help="HSDP replicate degree "
                                                                     "(divides --ranks).")),
        param("unit", list[str] | None, typer.Option(None, "--unit", help=unit_help)),
        *(config_option(f, _config_flag(f)) for f in config_fields(importer.Config)),
        param("buffer", str, typer.Option("32MB", "--buffer", help="Bytes per read (bounds "
                                                                    "memory).")),
        param("storage_option", list[str] | None, StorageOptionArg),
        param("json_out", bool, typer.Option(False, "--json", help="Print a JSON summary.")),
        param("sign_key", str | None, typer.Option(None, "--sign-key", help="Sign it with this "
                                                                             "Ed25519 key file.")),
    ]


def _run_import(importer: Any, args: dict[str, Any]) -> None:
    """``shardckpt import <importer.name>``: options checked (a bad one is exit code 2), the
    import run alone or as this process's part of a ``torchrun`` job, one line or JSON."""
    from shardckpt.interop.importer import ImportOptions, OptionError
    from shardckpt.tools.distributed import job_from_environment
    from shardckpt.tools.jobs import run_import

    opts = parse_storage_options(args["storage_option"])
    config = config_values(config_fields(importer.Config), args, _config_flag)
    try:
        options = ImportOptions(args["src"], args["dst"], args["ranks"], args["replicate"],
                                tuple(args["unit"]) if args["unit"] else None,
                                parse_bytes(args["buffer"], "--buffer"), opts, opts,
                                importer.Config(**config), signing_key=args["sign_key"])
    except OptionError as e:
        fail(e.spelled(_flag), EXIT_USAGE)
    # under torchrun: each process writes its share of the files, or rank 0 imports while the
    # others wait (``importer.splits``)
    with job_from_environment() as job:
        m = run_import(importer, options, job)
    if m is None:  # another process of the job reports
        return
    _report(m, options.dst, importer, args["json_out"],
            lambda s: importer.summary_line(s, options, human_bytes))


def _register_importers() -> None:
    from shardckpt.interop.importer import IMPORTERS, get_importer

    add_commands(import_app, "import", (get_importer(n) for n in IMPORTERS), _import_parameters,
                 _run_import)


_register_importers()
