"""``shardckpt import``: foreign checkpoints into the shardckpt format (``hf``, ``deepspeed``,
``dcp``); ``shardckpt export``: a shardckpt checkpoint out to a foreign format (``dcp``).

Thin: parse options, call the importer or exporter, print one line or JSON of what it wrote.
Errors become one line on stderr and a non-zero exit (``guarded``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import typer

from shardckpt.cli.app import app
from shardckpt.cli.common import (
    EXIT_USAGE, StorageOptionArg, echo_json, fail, guarded, human_bytes, parse_bytes, parse_storage_options,
)


def _check_mesh(ranks: int, replicate: int) -> None:
    if ranks < 1 or replicate < 1 or ranks % replicate:
        fail(f"--ranks {ranks} must be a positive multiple of --replicate {replicate}", EXIT_USAGE)


def _report(m: Any, dst: str, source_format: str, json_out: bool,
            line: Callable[[dict[str, Any]], str]) -> None:
    """What an import wrote (:func:`shardckpt.interop.importing.import_summary`): JSON, or the
    line ``line`` makes of it."""
    from shardckpt.interop.importing import import_summary

    summary = import_summary(m, dst, source_format)
    if json_out:
        echo_json(summary)
    else:
        typer.echo(line(summary))


import_app = typer.Typer(help="Import a foreign checkpoint as a shardckpt checkpoint.",
                         no_args_is_help=True, rich_markup_mode=None)
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
    from shardckpt.interop.hf.import_ import import_hf
    from shardckpt.tools.distributed import job_from_environment
    from shardckpt.tools.jobs import run_import

    _check_mesh(ranks, replicate)
    opts = parse_storage_options(storage_option)
    with job_from_environment() as job:  # under torchrun: this process's share of the files
        m = run_import(import_hf, src, dst, ranks, replicate, unit, opts, opts,
                       parse_bytes(buffer, "--buffer"), job=job)
    if m is None:  # another process of the job reports
        return
    _report(m, dst, "hf", json_out, lambda s: (
        f"imported {src} -> {dst}: {s['params']} tensors, {s['units']} units, {ranks} ranks, "
        f"{human_bytes(s['bytes'])}"))


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
    from shardckpt.interop.deepspeed.import_ import import_deepspeed
    from shardckpt.tools.distributed import job_from_environment
    from shardckpt.tools.jobs import run_import

    _check_mesh(ranks, replicate)
    opts = parse_storage_options(storage_option)
    with job_from_environment() as job:  # under torchrun: this process's share of the files
        m = run_import(import_deepspeed, src, dst, ranks, replicate, unit, tag, opts, opts,
                       parse_bytes(buffer, "--buffer"), tmp_dir, job=job)
    if m is None:  # another process of the job reports
        return
    _report(m, dst, "deepspeed", json_out, lambda s: (
        f"imported {src} (ZeRO-{s['zero_stage']}, {s['source_world_size']} ranks, step "
        f"{s['step']}) -> {dst}: {s['params']} parameters, {ranks} ranks, "
        f"{human_bytes(s['bytes'])}"))


@import_app.command("dcp")
@guarded
def import_dcp_command(
    src: str = typer.Argument(..., help="Folder DCP's FileSystemWriter wrote (holds .metadata and "
                                        "__*_*.distcp; path or fsspec URL)."),
    dst: str = typer.Argument(..., help="Checkpoint to create (path or fsspec URL)."),
    ranks: Optional[int] = typer.Option(None, "--ranks", help="Write ZeroEngine flat groups for "
                                        "this world size (default: keep DCP's chunks)."),
    replicate: int = typer.Option(1, "--replicate", help="HSDP replicate degree (divides --ranks)."),
    unit: Optional[list[str]] = typer.Option(
        None, "--unit", help="With --ranks: regular expression whose match (whole name "
                             "components) is one unit (repeatable). Default: (?:.*\\.)?layers\\.\\d+."),
    model_key: str = typer.Option("model", "--model-key", help="With --ranks: the state-dict key "
                                  "of the model ('' for torchtitan's top-level model keys)."),
    optim_key: Optional[str] = typer.Option(None, "--optim-key", help="With --ranks: the key of "
                                            "the optimizer (default: optim or optimizer)."),
    frozen: Optional[list[str]] = typer.Option(
        None, "--frozen", help="With --ranks: regular expression matching (whole) the FQN of "
                               "frozen parameters (requires_grad=False; repeatable). A model "
                               "tensor without optimizer state is a frozen parameter when a param "
                               "group lists it or it matches --frozen, else a buffer."),
    buffer: str = typer.Option("32MB", "--buffer", help="Bytes per read (bounds memory)."),
    tmp_dir: Optional[str] = typer.Option(None, "--tmp-dir", help="With --ranks: local folder "
                                          "for the staged source (about its size)."),
    storage_option: Optional[list[str]] = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Write a DCP checkpoint as a shardckpt checkpoint (its chunks, or flat groups for --ranks).

    With --ranks, a model tensor with optimizer state (Adam's exp_avg and exp_avg_sq, or SGD's
    momentum_buffer) is a trained parameter;
    one without, equal to a trained parameter, is tied to it; one a param group lists, or
    matching --frozen, is a frozen parameter (its own dtype); any other is a persistent buffer.
    """
    from shardckpt.interop.dcp.import_ import import_dcp
    from shardckpt.tools.distributed import job_from_environment
    from shardckpt.tools.jobs import run_import

    opts = parse_storage_options(storage_option)
    if ranks is None:
        if frozen:
            fail("--frozen needs --ranks (chunks keep every tensor as it is)", EXIT_USAGE)
        with job_from_environment() as job:  # under torchrun: rank 0 imports, the others wait
            m = run_import(import_dcp, src, dst, opts, opts, job=job, split=False)
        if m is None:
            return
        _report(m, dst, "dcp", json_out, lambda s: (
            f"imported {src} -> {dst}: {s['tensors']} tensors, {s['values']} other values, "
            f"{human_bytes(s['bytes'])}"))
        return
    from shardckpt.interop.dcp.to_flat import import_dcp_flat

    _check_mesh(ranks, replicate)
    with job_from_environment() as job:  # under torchrun: this process's share of the files
        m = run_import(import_dcp_flat, src, dst, ranks, replicate, unit, model_key, optim_key,
                       opts, opts, parse_bytes(buffer, "--buffer"), tmp_dir, frozen or (), job=job)
    if m is None:
        return
    _report(m, dst, "dcp", json_out, lambda s: (
        f"imported {src} -> {dst}: {s['params']} parameters, {s['units']} units, {ranks} ranks, "
        f"{human_bytes(s['bytes'])}"))


export_app = typer.Typer(help="Export a shardckpt checkpoint to a foreign format.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(export_app, name="export")


@export_app.command("dcp")
@guarded
def export_dcp_command(
    src: str = typer.Argument(..., help="shardckpt checkpoint (path or fsspec URL)."),
    dst: str = typer.Argument(..., help="Folder to write for DCP's FileSystemReader (must not "
                                        "hold a .metadata)."),
    model_key: str = typer.Option("model", "--model-key", help="Flat groups: the state-dict key "
                                  "the model is written under."),
    optim_key: str = typer.Option("optim", "--optim-key", help="Flat groups: the state-dict key "
                                  "the optimizer is written under."),
    buffer: str = typer.Option("32MB", "--buffer", help="Most bytes of one DCP chunk: a larger "
                               "box is written as several (bounds memory)."),
    file_size: str = typer.Option("1GiB", "--file-size", help="Start a new .distcp file once "
                                  "one holds this many bytes."),
    storage_option: Optional[list[str]] = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Write SRC as a directory stock dcp.load reads (.metadata and __<n>_0.distcp); .metadata last."""
    from shardckpt.interop.dcp.export import export_dcp

    opts = parse_storage_options(storage_option)
    summary = export_dcp(src, dst, opts, opts, model_key, optim_key,
                         parse_bytes(buffer, "--buffer"), parse_bytes(file_size, "--file-size"))
    if json_out:
        echo_json(summary)
    else:
        typer.echo(f"exported {src} -> {dst}: {summary['tensors']} tensors, {summary['values']} "
                   f"other values, {len(summary['files'])} files, {human_bytes(summary['bytes'])}")
