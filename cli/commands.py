"""Format-core commands: synth, inspect, verify."""

from __future__ import annotations

import functools
from typing import Any

import typer

from .app import app
from .common import (
    EXIT_FAILED, EXIT_USAGE, StorageOptionArg, checkpoint_location, console, echo, echo_json, fail,
    guarded, human_bytes, parse_count, parse_storage_options, progress, safe_text,
)


@app.command()
@guarded
def synth(
    dst: str = typer.Argument(..., help="Where to write the checkpoint (path or fsspec URL)."),
    params: str = typer.Option(..., "--params", help="About how many parameters (1e6, 125M, 1.5B)."),
    ranks: int = typer.Option(..., "--ranks", help="World size N that 'wrote' it."),
    replicate: int = typer.Option(1, "--replicate", help="HSDP replicate degree R (N/R shards)."),
    units: int = typer.Option(2, "--units", help="Number of transformer blocks."),
    seed: int = typer.Option(0, "--seed"),
    step: int = typer.Option(100, "--step", help="Training step recorded in the checkpoint."),
    workers: int = typer.Option(2, "--workers", help="Shards written in parallel."),
    storage_option: list[str] | None = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Write a valid synthetic checkpoint of a Llama-shaped layout (fp32 masters + AdamW moments)."""
    from shardckpt.tools.synth import synth_bytes, synthesize

    n = parse_count(params, "--params")
    if ranks < 1:
        fail(f"--ranks {ranks}: must be >= 1", EXIT_USAGE)
    with progress(synth_bytes(n, ranks, replicate, units), "synth") as tick:
        m = synthesize(dst, n, ranks, replicate, units, seed, step,
                       parse_storage_options(storage_option), workers, progress=tick)
    if json_out:
        echo_json({"url": dst, "save_id": m.save_id, "bytes": m.total_bytes, "files": len(m.files),
                   "world_size": m.mesh.world_size})
    else:
        echo(f"wrote {dst}: {len(m.files)} files, {human_bytes(m.total_bytes)}, "
             f"mesh {m.mesh.describe()}, save {m.save_id}")


@app.command()
@guarded
def inspect(
    ckpt: str = typer.Argument(..., help="Checkpoint or run directory (path or fsspec URL)."),
    storage_option: list[str] | None = StorageOptionArg,
    params: bool = typer.Option(True, "--params/--no-params", help="List every parameter."),
    limit: int = typer.Option(1000, "--limit", help="Parameters listed per component (0: all)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables (lists every parameter)."),
) -> None:
    """Show a checkpoint's format version, mesh, step, components, groups, parameters, states and files."""
    from shardckpt.checkpoint.reader import read_manifest
    from shardckpt.checkpoint.run_retention import run_holdings
    from shardckpt.tools.summary import summarize

    opts = parse_storage_options(storage_option)
    where = checkpoint_location(ckpt, opts)
    m = read_manifest(where.storage)  # once: the summary and the run's listing share it
    s = summarize(m, where.storage.url)
    # a run directory: what each of its checkpoints holds, through the storage already open
    run = run_holdings(where.run, opts, {where.url: m}) if where.run is not None else None
    if json_out:
        echo_json({**s, "run": run} if run is not None else s)
        return
    for r in run or ():
        echo(f"{r['name']}: {', '.join(r['holds'])}")
    _print_summary(s, params, limit)


def _print_summary(s: dict[str, Any], params: bool, limit: int) -> None:
    """Tables of :func:`shardckpt.tools.summary.summarize`; every name is printed as plain text."""
    from rich.table import Table
    from rich.text import Text

    con = console()
    t = safe_text
    mesh = " x ".join(f"{t(k)}={v}" for k, v in s["mesh"].items())
    con.print(Text.assemble((t(s["url"]), "bold"), f"  format {s['format_version']}  save "
                            f"{t(s['save_id'])}  step {t(s['step'])}  mesh {mesh} (world {s['world_size']})"))
    con.print("holds: " + ", ".join(t(h) for h in s["holds"]))
    if s["optimizer"]:
        groups = ", ".join(f"{pg['params']} params wd={t(pg['hparams'].get('weight_decay'))}"
                           for pg in s["optimizer"]["param_groups"])
        con.print(f"optimizer {t(s['optimizer']['name'])}: {groups}")
    for name, c in s["components"].items():
        table = Table(title=f"component {t(name)}: {c['parameters']} parameters, "
                            f"{c['elements']:,} elements ({c['trainable_elements']:,} trainable)")
        for col in ("group", "unit", "dtype", "trainable", "params", "numel", "padded", "states"):
            table.add_column(col)
        for g in c["groups"]:
            table.add_row(t(g["name"]), t(g["unit"] or "(root)"), g["dtype"], str(g["requires_grad"]),
                          str(g["params"]), f"{g['numel']:,}", f"{g['padded_numel']:,}",
                          t(",".join(g["states"])))
        con.print(table)
        if params:
            _print_params(con, name, c, limit)
        kinds = ", ".join(f"{t(k)}: {human_bytes(v['bytes'])}" for k, v in c["state_kinds"].items())
        con.print(f"state bytes: {kinds}")
        if c["aliases"]:
            con.print("tied: " + ", ".join(f"{t(a)} -> {t(b)}" for a, b in c["aliases"].items()))
    if s.get("chunked"):
        _print_chunked(con, s["chunked"], params, limit)
    ft = Table(title=f"{len(s['files'])} files, {human_bytes(s['total_bytes'])}")
    for col in ("path", "role", "size", "crc32c"):
        ft.add_column(col)
    for f in s["files"]:
        ft.add_row(t(f["path"]), f["role"], f"{f['size']:,}", f["crc32c"])
    con.print(ft)


def _print_chunked(con: Any, c: dict[str, Any], params: bool, limit: int) -> None:
    from rich.table import Table

    t = safe_text
    con.print(f"chunked tensors: {len(c['tensors'])} tensors, {c['elements']:,} elements, "
              f"{human_bytes(c['tensor_bytes'])}; {len(c['blobs'])} opaque blobs, "
              f"{human_bytes(sum(b['bytes'] for b in c['blobs']))}")
    if not params:
        return
    rows = c["tensors"] if limit <= 0 else c["tensors"][:limit]
    table = Table(title="chunked tensors")
    for col in ("tensor", "shape", "dtype", "chunks"):
        table.add_column(col, no_wrap=col == "tensor")
    for r in rows:
        table.add_row(t(r["fqn"]), str(tuple(r["shape"])), r["dtype"], str(r["chunks"]))
    con.print(table)
    if len(c["tensors"]) > len(rows):
        con.print(f"... {len(c['tensors']) - len(rows)} more tensors not listed (--limit 0 lists all)")


def _print_params(con: Any, name: str, c: dict[str, Any], limit: int) -> None:
    from rich.table import Table

    t = safe_text
    rows = c["params"] if limit <= 0 else c["params"][:limit]
    table = Table(title=f"parameters of {t(name)}")
    for col in ("parameter", "shape", "dtype", "unit", "group"):
        table.add_column(col, no_wrap=col == "parameter")
    for p in rows:
        table.add_row(t(p["fqn"]), str(tuple(p["shape"])), p["dtype"], t(p["unit"] or "(root)"),
                      t(p["group"]))
    for b in c["buffers"]:
        table.add_row(t(b["fqn"]), str(tuple(b["shape"])), b["dtype"], "", "(buffer)")
    con.print(table)
    hidden = len(c["params"]) - len(rows)
    if hidden:
        con.print(f"... {hidden} more parameters not listed (--limit 0 lists all; --json holds all)")


@app.command()
@guarded
def verify(
    ckpt: str = typer.Argument(..., help="Checkpoint or run directory (path or fsspec URL)."),
    storage_option: list[str] | None = StorageOptionArg,
    workers: int = typer.Option(4, "--workers", help="Files checked in parallel."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON report."),
    digests: bool = typer.Option(False, "--digests", help="Also check each file's digest (BLAKE3 or SHA-256)."),
    trust: str | None = typer.Option(None, "--trust", help="Public key file(s), comma-separated: "
                                     "refuse a checkpoint not signed by one (implies --digests)."),
) -> None:
    """Check every file's presence, size, checksums and header; exit 0 only if all hold."""
    from shardckpt.tools.distributed import job_from_environment
    from shardckpt.tools.jobs import run_verify

    opts = parse_storage_options(storage_option)
    if trust:  # a consolidation (Hugging Face output): its signed provenance, checked
        from shardckpt.tools.consolidate_sign import trusted_consolidation
        if (line := trusted_consolidation(ckpt, opts, trust)) is not None:
            return echo(line)
    where = checkpoint_location(ckpt, opts)  # a run directory: the checkpoint its latest names
    ckpt = where.url
    with job_from_environment() as job:  # under torchrun: this process checks its share
        result = run_verify(where.storage, opts, workers, job,
                            functools.partial(progress, description="verify"), digests, trust)
    if job is not None and not job.is_root:
        if not result:
            raise typer.Exit(EXIT_FAILED)
        return
    if json_out:
        echo_json({"url": ckpt, "ok": result.ok, "problems": list(result.problems),
                   "files": [{"path": r.path, "size": r.size, "ok": r.ok, "problems": list(r.problems)}
                             for r in result.reports]})
    else:
        for p in result.problems:
            echo(f"error: {p}", err=True)
        if result and result.manifest is not None:
            echo(f"ok: {ckpt}: {len(result.reports)} files, "
                       f"{human_bytes(result.manifest.total_bytes)} verified")
    if not result:
        raise typer.Exit(EXIT_FAILED)
