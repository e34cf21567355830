"""``shardckpt import``: foreign checkpoints into the shardckpt format (``hf``, ``deepspeed``,
``dcp``). Its twin, ``shardckpt export``, is :mod:`.exporters`.

Thin: parse options, call the importer, print one line or JSON of what it wrote.
Errors become one line on stderr and a non-zero exit (``guarded``). The ``import`` commands are
one body (:func:`_run_import`) for every importer of :data:`shardckpt.interop.importer.IMPORTERS`:
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
    EXIT_USAGE, StorageOptionArg, echo_json, fail, guarded, human_bytes, parse_bytes, parse_storage_options,
)


#: Common options of :class:`shardckpt.interop.importer.ImportOptions` -> their flags.
_FLAGS = {"ranks": "--ranks", "replicate": "--replicate", "units": "--unit",
          "buffer_bytes": "--buffer", "storage_options": "--storage-option"}


def _flag(field: str) -> str:
    """The command-line spelling of an import option (common, or of an importer's config)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


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


def _config_fields(importer: Any) -> list[dataclasses.Field[Any]]:
    """The fields of the importer's config that the command line sets (those with a help)."""
    return [f for f in dataclasses.fields(importer.Config) if "help" in f.metadata]


def _config_option(f: dataclasses.Field[Any]) -> inspect.Parameter:
    """A typer option for config field ``f``: a tuple is a repeatable option, None an optional
    value, anything else a value with that default."""
    default = f.default
    if isinstance(default, tuple):
        annotation: Any = list[str] | None
        default = None
    elif default is None:
        annotation = str | None
    else:
        annotation = type(default)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, _flag(f.name), help=f.metadata["help"]))


def _import_parameters(importer: Any) -> list[inspect.Parameter]:
    """The arguments and options of ``shardckpt import <importer.name>``."""
    def param(name: str, annotation: Any, default: Any) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                 default=default)

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
        *(_config_option(f) for f in _config_fields(importer)),
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
    config = {}
    for f in _config_fields(importer):
        value = args[f.name]
        config[f.name] = tuple(value or ()) if isinstance(f.default, tuple) else value
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


def _import_command(importer: Any) -> Callable[..., None]:
    """The command of one importer: its parameters (:func:`_import_parameters`), its help, and
    :func:`_run_import` as the body."""
    def command(**args: Any) -> None:
        _run_import(importer, args)

    command.__name__ = command.__qualname__ = f"import_{importer.name}_command"
    command.__doc__ = importer.help
    command.__signature__ = inspect.Signature(_import_parameters(importer))  # type: ignore[attr-defined]
    return command


def _register_importers() -> None:
    from shardckpt.interop.importer import IMPORTERS, get_importer

    for name in IMPORTERS:
        import_app.command(name)(guarded(_import_command(get_importer(name))))


_register_importers()
