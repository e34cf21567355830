"""The typer application object. Command modules register on it; heavy imports stay inside commands.

Help and usage errors are plain text (``rich_markup_mode=None``): typer's rich formatter imports
rich's markdown, syntax and traceback machinery, which about doubles the time ``shardckpt --help``
takes. Commands still print their own tables and progress bars with rich.
"""

from __future__ import annotations

import typer

#: The top-level help: what the tool is, then every command by what a user wants to do
#: (``tests/test_cli_core.py`` holds it to the commands registered).
HELP = """Sharded checkpoints for ZeRO-3 / FSDP.

Look: inspect, verify, diff, estimate. Convert: reshard, consolidate, import, export.
Trust: sign (and verify --trust).
Operate: watch, clean. Try: synth, demo. Run `shardckpt COMMAND --help` for one command."""

app = typer.Typer(
    name="shardckpt",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from shardckpt import __version__

        typer.echo(f"shardckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _group(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print shardckpt's version and exit."),
) -> None:
    # A callback keeps ``app`` a group of commands however many are registered: the console
    # script (:mod:`shardckpt.cli.run`) registers only the command it runs.
    pass
