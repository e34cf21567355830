"""`shardckpt reshard`: N ranks -> M ranks (or another HSDP mesh), streaming, bounded memory."""

from __future__ import annotations

import functools

import typer

from .app import app
from .common import (
    StorageOptionArg, checkpoint_location, echo_json, guarded, human_bytes, parse_bytes,
    parse_storage_options, progress,
)


@app.command()
@guarded
def reshard(
    src: str = typer.Argument(..., help="Source checkpoint (path or fsspec URL)."),
    dst: str = typer.Argument(..., help="Destination directory (path or fsspec URL)."),
    to: int = typer.Option(..., "--to", help="Target world size M."),
    from_: int | None = typer.Option(None, "--from", help="Guard: the source's world size N."),
    replicate: int = typer.Option(1, "--replicate", help="Target HSDP replicate degree R (mesh R x M/R)."),
    workers: int = typer.Option(1, "--workers", help="Processes that split the target shards "
                                "(under torchrun, the job's processes split them instead)."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace DST (a damaged checkpoint too) once the new one is "
                                        "complete, then remove earlier attempts' directories there."),
    buffer: str = typer.Option("32MB", "--buffer",
                               help="Bytes held per read batch (bounds memory; at least 64KiB): "
                                    "B, KB, MB, GB (powers of 1000) or KiB, MiB, GiB."),
    format_: str | None = typer.Option(
        None, "--format", help="chunked: the chunks FSDP2 would save at M ranks (the default for "
                               "a checkpoint saved through DCP); flat: ZeroEngine flat groups "
                               "(the default for flat groups)."),
    storage_option: list[str] | None = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary."),
    sign_key: str | None = typer.Option(None, "--sign-key", help="Sign DST with this Ed25519 key file."),
) -> None:
    """Reshard SRC (N ranks) into DST (M ranks); DST's manifest is written last.

    A checkpoint saved through DCP (FSDP2) becomes the chunks FSDP2 saves at M ranks (each
    tensor split along its first dim), or with --format flat ZeroEngine flat groups.

    Under torchrun (`torchrun --nproc_per_node K -m shardckpt reshard ...`) the job's processes
    split the target files by bytes and rank 0 commits once all are written."""
    from shardckpt.tools.distributed import job_from_environment
    from shardckpt.tools.jobs import run_reshard

    opts = parse_storage_options(storage_option)
    where = checkpoint_location(src, opts)  # a run directory: the checkpoint its latest names
    src = where.url
    buffer_bytes = parse_bytes(buffer, "--buffer")
    with job_from_environment() as job:  # under torchrun: this process's share of the job
        r = run_reshard(where.storage, dst, to, from_, replicate, workers, overwrite, opts,
                        buffer_bytes, job, functools.partial(progress, description="reshard"),
                        fmt=format_, signing_key=sign_key)
    if job is not None and not job.is_root:
        return
    m = r.manifest
    if json_out:
        echo_json({"src": src, "dst": dst, "from": r.source_world_size, "to": m.mesh.world_size,
                   "mesh": {a: s for a, s in m.mesh.axes}, "save_id": m.save_id,
                   "format": "flat" if m.chunked is None else "chunked",
                   "bytes_written": r.bytes_written, "bytes_read": r.bytes_read,
                   "seconds": round(r.seconds, 3),
                   "gb_per_s": round(r.bytes_written / 1e9 / max(r.seconds, 1e-9), 3)})
    else:
        typer.echo(f"resharded {src} ({r.source_world_size} ranks) -> {dst} ({m.mesh.describe()}): "
                   f"{human_bytes(r.bytes_written)} in {r.seconds:.2f} s; committed save {m.save_id}")
