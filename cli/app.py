"""The typer application object. Command modules register on it; heavy imports stay inside commands."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="shardckpt",
    help="Sharded checkpoints for ZeRO-3 / FSDP: inspect, verify, reshard, consolidate, demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
