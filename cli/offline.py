"""Offline commands: ``consolidate`` (shards -> Hugging Face safetensors) and ``diff``.

Thin: parse options, call :mod:`shardckpt.tools.consolidate` / :mod:`shardckpt.tools.diff`, print a line, a
table or JSON. Errors become one line on stderr and a non-zero exit (``guarded``); ``diff`` exits
0 only when the checkpoints are equal and 1 when they differ.
"""

from __future__ import annotations

import functools

import typer

from .app import app
from .common import (
    EXIT_FAILED, StorageOptionArg, checkpoint_location, console, echo, echo_json, guarded, human_bytes,
    parse_bytes, parse_storage_options, progress, safe_text,
)

@app.command()
@guarded
def consolidate(
    src: str = typer.Argument(..., help="Source checkpoint or run directory (path or fsspec URL)."),
    dst: str = typer.Argument(..., help="Output directory (path or fsspec URL)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp16 | fp32 (floating tensors)."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output file: 5GB, 500MB, 1e9."),
    component: str = typer.Option("model", "--component", help="Which component to consolidate."),
    prefix: str | None = typer.Option(None, "--prefix", help="Chunked (DCP) checkpoints: consolidate "
                                      "the tensors whose name starts with this, named without it "
                                      "(default: the one the writer recorded; model., or "
                                      "state_dict.<attr>. for Lightning)."),
    optimizer: bool = typer.Option(False, "--optimizer", help="Also write optimizer states (fp32)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace consolidated files already in DST."),
    copy_from: str | None = typer.Option(
        None, "--copy-from", help="Model folder (path or fsspec URL) whose tokenizer and generation "
                                  "files (and config.json, if the checkpoint has none) are copied."),
    buffer: str = typer.Option("64MB", "--buffer", help="Bytes held in memory at a time (bounds memory)."),
    keep_buffers: bool = typer.Option(False, "--keep-buffers", help="Also write the persistent "
                                      "buffers (left out by default: transformers reports one its "
                                      "class lacks as UNEXPECTED); for models that keep them, "
                                      "such as BatchNorm statistics."),
    storage_option: list[str] | None = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary."),
    sign_key: str | None = typer.Option(None, "--sign-key", help="Sign DST with this Ed25519 key file."),
) -> None:
    """Write SRC as Hugging Face safetensors (and config.json) in DST; its index is written last."""
    from shardckpt.tools.distributed import job_from_environment
    from shardckpt.tools.jobs import run_consolidate

    size = parse_bytes(max_shard_size, "--max-shard-size")
    buffer_bytes = parse_bytes(buffer, "--buffer")
    opts = parse_storage_options(storage_option)
    where = checkpoint_location(src, opts)  # a run directory: the checkpoint its latest names
    src = where.url
    with job_from_environment() as job:  # under torchrun: this process's share of the files
        r = run_consolidate(where.storage, dst, dtype, size, component, prefix, optimizer, overwrite, copy_from,
                            opts, buffer_bytes, job,
                            functools.partial(progress, description="consolidate"), keep_buffers)
    if job is not None and not job.is_root:
        return
    if sign_key:  # once committed, by one process: reads each output file once
        from shardckpt.tools.consolidate_sign import sign_consolidation
        sign_consolidation(dst, sign_key, opts)
    if json_out:
        from shardckpt.tools.hf_export import consolidation_summary

        echo_json(consolidation_summary(r, src, dst))
    else:
        extra = f" + {len(r.optimizer_files)} optimizer files" if r.optimizer_files else ""
        echo(f"consolidated {src} -> {dst}: {r.tensors} tensors ({r.dtype}) in {len(r.files)} "
                   f"files{extra}, {human_bytes(r.bytes_written)} in {r.seconds:.2f} s")
        if not r.has_config:
            echo(f"note: no config.json written ({src} records no Hugging Face config); add one "
                 "with --copy-from MODEL_FOLDER, or save with hf_config=", err=True)
        if r.left_out_buffers:
            names = ", ".join(r.left_out_buffers[:3]) + (", ..." if len(r.left_out_buffers) > 3 else "")
            echo(f"note: {len(r.left_out_buffers)} persistent buffer(s) left out ({names}); "
                 "--keep-buffers writes them", err=True)


@app.command()
@guarded
def diff(
    a: str = typer.Argument(..., help="First checkpoint (path or fsspec URL)."),
    b: str = typer.Argument(..., help="Second checkpoint (path or fsspec URL)."),
    buffer: str = typer.Option("64MB", "--buffer", help="Bytes held in memory at a time."),
    limit: int = typer.Option(50, "--limit", help="Rows shown in the table (JSON lists all)."),
    atol: float | None = typer.Option(None, "--atol", min=0.0, help="Absolute tolerance: elements "
                                      "with |a - b| <= atol + rtol·|b| count as equal (runs on "
                                      "different world sizes differ in the last bits)."),
    rtol: float | None = typer.Option(None, "--rtol", min=0.0, help="Relative tolerance (see "
                                      "--atol; numpy.isclose's rule). Default: bit for bit."),
    storage_option: list[str] | None = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Compare A and B tensor by tensor, whatever their world sizes; exit 0 only if equal (bit
    for bit, or within --atol/--rtol)."""
    from shardckpt.tools.diff import Tolerance
    from shardckpt.tools.distributed import job_from_environment
    from shardckpt.tools.jobs import run_diff

    opts = parse_storage_options(storage_option)
    buffer_bytes = parse_bytes(buffer, "--buffer")
    tol = None if atol is None and rtol is None else Tolerance(atol or 0.0, rtol or 0.0)
    with job_from_environment() as job:  # under torchrun: this process compares its share
        r = run_diff(a, b, opts, buffer_bytes, job, functools.partial(progress, description="diff"),
                     tol)
    if job is not None and not job.is_root:
        if not r.equal:
            raise typer.Exit(EXIT_FAILED)
        return
    if json_out:
        echo_json(r.to_dict())
    elif r.equal and r.tolerance is not None:
        typer.echo(f"equal within atol {r.tolerance.atol:g}, rtol {r.tolerance.rtol:g}: "
                   f"{r.compared} tensors, {r.elements:,} elements per side; {r.identical} bit "
                   f"for bit, {r.close} within the tolerance")
    elif r.equal:
        typer.echo(f"equal: {r.compared} tensors, {r.elements:,} elements per side, bit for bit")
    else:
        from rich.table import Table

        t = safe_text
        shown = r.differences[:limit]
        many = any(d.component != "model" for d in shown)  # a component column only if needed
        total = r.compared + sum(d.status != "different" for d in r.differences)
        within = "" if r.tolerance is None else \
            f" beyond atol {r.tolerance.atol:g}, rtol {r.tolerance.rtol:g}"
        table = Table(title=f"{len(r.differences)} of {total} tensors differ{within}")
        detail = any(d.detail for d in shown)
        cols = (["component"] if many else []) + ["tensor", "kind", "status", "numel", "differing",
                                                  "max abs diff"] + (["detail"] if detail else [])
        for col in cols:
            table.add_column(col, no_wrap=col == "tensor")
        for d in shown:
            row = [t(d.name), t(d.kind), d.status, f"{d.numel:,}", f"{d.differing:,}",
                   f"{d.max_abs_diff:.6g}" if d.status == "different" else ""] + ([t(d.detail)] if detail else [])
            table.add_row(*(([t(d.component)] if many else []) + row))
        con = console()
        con.print(table)
        if len(r.differences) > limit:
            con.print(f"... and {len(r.differences) - limit} more (use --json for all)")
        for note in r.metadata:
            con.print(f"metadata: {t(note)}")
    if not r.equal:
        raise typer.Exit(EXIT_FAILED)
