"""Format-core commands: synth, inspect, verify."""

from __future__ import annotations

from typing import Optional

import typer

from shardckpt.cli.app import app
from shardckpt.cli.common import (
    EXIT_FAILED, StorageOptionArg, echo_json, guarded, human_bytes, parse_count,
    parse_storage_options, progress,
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
    storage_option: Optional[list[str]] = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Write a valid synthetic checkpoint of a Llama-shaped layout (fp32 masters + AdamW moments)."""
    from shardckpt.synth import synth_spec, synthesize
    from shardckpt.manifest import shard_slots

    n = parse_count(params, "--params")
    if ranks < 1:
        from shardckpt.cli.common import fail
        fail(f"--ranks {ranks}: must be >= 1", 2)
    spec = synth_spec(n, ranks, replicate, units, step, seed)
    slots = shard_slots(spec.components, spec.mesh)
    total = (slots[-1].end if slots else 0) * spec.mesh.shard_degree
    with progress(total, "synth") as tick:
        m = synthesize(dst, n, ranks, replicate, units, seed, step,
                       parse_storage_options(storage_option), workers, progress=tick)
    if json_out:
        echo_json({"url": dst, "save_id": m.save_id, "bytes": m.total_bytes, "files": len(m.files),
                   "world_size": m.mesh.world_size})
    else:
        typer.echo(f"wrote {dst}: {len(m.files)} files, {human_bytes(m.total_bytes)}, "
                   f"mesh {m.mesh.describe()}, save {m.save_id}")


@app.command()
@guarded
def inspect(
    ckpt: str = typer.Argument(..., help="Checkpoint directory (path or fsspec URL)."),
    storage_option: Optional[list[str]] = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Show a checkpoint's format version, mesh, step, components, groups, states and files."""
    from shardckpt.checkpoint import read_manifest, as_storage
    from shardckpt.summary import summarize

    storage = as_storage(ckpt, parse_storage_options(storage_option))
    s = summarize(read_manifest(storage), ckpt)
    if json_out:
        echo_json(s)
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    mesh = " x ".join(f"{k}={v}" for k, v in s["mesh"].items())
    con.print(f"[bold]{ckpt}[/]  format {s['format_version']}  save {s['save_id']}  "
              f"step {s['step']}  mesh {mesh} (world {s['world_size']})")
    if s["optimizer"]:
        groups = ", ".join(f"{pg['params']} params wd={pg['hparams'].get('weight_decay')}"
                           for pg in s["optimizer"]["param_groups"])
        con.print(f"optimizer {s['optimizer']['name']}: {groups}")
    for name, c in s["components"].items():
        t = Table(title=f"component {name}: {c['parameters']} parameters, "
                        f"{c['elements']:,} elements ({c['trainable_elements']:,} trainable)")
        for col in ("group", "unit", "dtype", "trainable", "params", "numel", "padded", "states"):
            t.add_column(col)
        for g in c["groups"]:
            t.add_row(g["name"], g["unit"] or "(root)", g["dtype"], str(g["requires_grad"]),
                      str(g["params"]), f"{g['numel']:,}", f"{g['padded_numel']:,}", ",".join(g["states"]))
        con.print(t)
        kinds = ", ".join(f"{k}: {human_bytes(v['bytes'])}" for k, v in c["state_kinds"].items())
        con.print(f"state bytes: {kinds}")
        if c["aliases"]:
            con.print("tied: " + ", ".join(f"{a} -> {b}" for a, b in c["aliases"].items()))
    ft = Table(title=f"{len(s['files'])} files, {human_bytes(s['total_bytes'])}")
    for col in ("path", "role", "size", "crc32c"):
        ft.add_column(col)
    for f in s["files"]:
        ft.add_row(f["path"], f["role"], f"{f['size']:,}", f["crc32c"])
    con.print(ft)


@app.command()
@guarded
def verify(
    ckpt: str = typer.Argument(..., help="Checkpoint directory (path or fsspec URL)."),
    storage_option: Optional[list[str]] = StorageOptionArg,
    workers: int = typer.Option(4, "--workers", help="Files checked in parallel."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Check every file's presence, size, checksums and header; exit 0 only if all hold."""
    from shardckpt.checkpoint import as_storage, read_manifest, verify as run_verify

    storage = as_storage(ckpt, parse_storage_options(storage_option))
    try:
        total = read_manifest(storage).total_bytes
    except Exception:  # noqa: BLE001 - reported by run_verify below
        total = 0
    with progress(total, "verify") as tick:
        m, reports, problems = run_verify(storage, workers=workers, progress=tick)
    problems = problems + [p for r in reports for p in r.problems]
    ok = not problems
    if json_out:
        echo_json({"url": ckpt, "ok": ok, "problems": problems,
                   "files": [{"path": r.path, "size": r.size, "ok": r.ok, "problems": list(r.problems)}
                             for r in reports]})
    else:
        for p in problems:
            typer.echo(f"error: {p}", err=True)
        if ok and m is not None:
            typer.echo(f"ok: {ckpt}: {len(reports)} files, {human_bytes(m.total_bytes)} verified")
    if not ok:
        raise typer.Exit(EXIT_FAILED)
