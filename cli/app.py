"""The typer application object. Command modules register on it; heavy imports stay inside commands.

Help and usage errors are plain text (``rich_markup_mode=None``): typer's rich formatter imports
rich's markdown, syntax and traceback machinery, which about doubles the time ``shardckpt --help``
takes. Commands still print their own tables and progress bars with rich.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="shardckpt",
    help="Sharded checkpoints for ZeRO-3 / FSDP: inspect, verify, reshard, consolidate, demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _group() -> None:
    # A callback keeps ``app`` a group of commands however many are registered: the console
    # script (:mod:`shardckpt.cli.run`) registers only the command it runs.
    pass
