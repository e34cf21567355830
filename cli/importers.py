"""``shardckpt import``: foreign checkpoints into the shardckpt format (``hf``, ``deepspeed``).

Thin: parse options, call :func:`shardckpt.hf.import_hf`, print one line or JSON. Errors become
one line on stderr and a non-zero exit (``guarded``).
"""

from __future__ import annotations

from typing import Optional

import typer

from shardckpt.cli.app import app
from shardckpt.cli.common import (
    EXIT_USAGE, StorageOptionArg, echo_json, fail, guarded, human_bytes, parse_storage_options,
)
from shardckpt.cli.offline import parse_size

import_app = typer.Typer(help="Import a foreign checkpoint as a shardckpt checkpoint.",
                         no_args_is_help=True)
app.add_typer(import_app, name="import")


@import_app.command("hf")
@guarded
def import_hf_command(
    src: str = typer.Argument(..., help="Hugging Face model folder, index or .safetensors file "
                                        "(path or fsspec URL)."),
    dst: str = typer.Argument(..., help="Checkpoint to create (path or fsspec URL)."),
    ranks: int = typer.Option(..., "--ranks", help="World size the checkpoint is laid out for."),
    replicate: int = typer.Option(1, "--replicate", help="HSDP replicate degree (divides --ranks)."),
    unit: Optional[list[str]] = typer.Option(
        None, "--unit", help="Regular expression whose match (whole name components) is one unit "
                             "(repeatable). Default: model\\.layers\\.\\d+ (one unit per block)."),
    buffer: str = typer.Option("32MB", "--buffer", help="Bytes per read (bounds memory)."),
    storage_option: Optional[list[str]] = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Write SRC's weights as a weights-only checkpoint for --ranks ranks; manifest last."""
    from shardckpt.hf import import_hf

    if ranks < 1 or replicate < 1 or ranks % replicate:
        fail(f"--ranks {ranks} must be a positive multiple of --replicate {replicate}", EXIT_USAGE)
    opts = parse_storage_options(storage_option)
    m = import_hf(src, dst, ranks, replicate, unit, opts, opts, parse_size(buffer, "--buffer"))
    comp = m.components["model"]
    summary = {"destination": dst, "save_id": m.save_id, "ranks": ranks, "replicate": replicate,
               "params": len(comp.layout.params), "units": len({g.unit for g in comp.layout.groups}),
               "bytes": m.total_bytes, "hf_config": "hf_config" in m.extras}
    if json_out:
        echo_json(summary)
    else:
        typer.echo(f"imported {src} -> {dst}: {summary['params']} tensors, {summary['units']} "
                   f"units, {ranks} ranks, {human_bytes(m.total_bytes)}")


@import_app.command("deepspeed")
@guarded
def import_deepspeed_command(
    src: str = typer.Argument(..., help="Folder DeepSpeed's engine.save_checkpoint wrote (holds "
                                        "'latest' and the tag folders; path or fsspec URL)."),
    dst: str = typer.Argument(..., help="Checkpoint to create (path or fsspec URL)."),
    ranks: int = typer.Option(..., "--ranks", help="World size the checkpoint is laid out for."),
    replicate: int = typer.Option(1, "--replicate", help="HSDP replicate degree (divides --ranks)."),
    unit: Optional[list[str]] = typer.Option(
        None, "--unit", help="Regular expression whose match (whole name components) is one unit "
                             "(repeatable). Default: (?:.*\\.)?layers\\.\\d+ (one unit per block)."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Tag folder to import (default: the "
                                                          "one 'latest' names)."),
    buffer: str = typer.Option("32MB", "--buffer", help="Bytes per read (bounds memory)."),
    tmp_dir: Optional[str] = typer.Option(None, "--tmp-dir", help="Local folder for the staged "
                                          "fp32 state (about the size of the optimizer files)."),
    storage_option: Optional[list[str]] = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Write a DeepSpeed ZeRO-1/2/3 checkpoint (weights, Adam state, buffers) for --ranks ranks."""
    from shardckpt.deepspeed_import import import_deepspeed

    if ranks < 1 or replicate < 1 or ranks % replicate:
        fail(f"--ranks {ranks} must be a positive multiple of --replicate {replicate}", EXIT_USAGE)
    opts = parse_storage_options(storage_option)
    m = import_deepspeed(src, dst, ranks, replicate, unit, tag, opts, opts,
                         parse_size(buffer, "--buffer"), tmp_dir)
    comp = m.components["model"]
    ds = m.extras.get("deepspeed", {})
    summary = {"destination": dst, "save_id": m.save_id, "ranks": ranks, "replicate": replicate,
               "params": len(comp.layout.params), "units": len({g.unit for g in comp.layout.groups}),
               "bytes": m.total_bytes, "step": m.extras.get("step"), "zero_stage": ds.get("stage"),
               "source_world_size": ds.get("world_size")}
    if json_out:
        echo_json(summary)
    else:
        typer.echo(f"imported {src} (ZeRO-{ds.get('stage')}, {ds.get('world_size')} ranks, step "
                   f"{m.extras.get('step')}) -> {dst}: {summary['params']} parameters, "
                   f"{ranks} ranks, {human_bytes(m.total_bytes)}")
