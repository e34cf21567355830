"""`shardckpt clean`: remove debris of uncommitted saves; list and abort stale multipart uploads."""

from __future__ import annotations


import typer

from .app import app
from .common import StorageOptionArg, echo_json, guarded, parse_storage_options


@app.command()
@guarded
def clean(
    prefix: str = typer.Argument(..., help="A checkpoint, or a run directory of step-* checkpoints."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed; remove nothing."),
    min_age: float = typer.Option(3600.0, "--min-age",
                                  help="Seconds a save or upload must be old before it counts as debris "
                                       "(protects saves in progress; a save whose writer holds a "
                                       "lease is kept whatever its age)."),
    storage_option: list[str] | None = StorageOptionArg,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Remove save directories no manifest names; abort multipart uploads left open.

    Nothing outside PREFIX is touched: symbolic links below it are reported, never followed
    or removed."""
    from shardckpt.tools.clean import clean as run

    r = run(prefix, dry_run=dry_run, min_age_s=min_age, storage_options=parse_storage_options(storage_option))
    if json_out:
        echo_json({"prefix": prefix, "dry_run": dry_run, "debris": r.debris, "kept_young": r.kept_young,
                   "kept_live": r.kept_live, "kept_referenced": r.kept_referenced,
                   "committed": r.committed,
                   "links": [{"path": p, "target": t} for p, t in r.links],
                   "open_uploads": [{"key": u.key, "upload_id": u.upload_id, "initiated": u.initiated}
                                    for u in r.uploads],
                   "aborted_uploads": [u.key for u in r.aborted]})
        return
    verb = "would remove" if dry_run else "removed"
    for d in r.debris:
        typer.echo(f"{verb} {d}")
    for d in r.kept_young:
        typer.echo(f"kept {d} (younger than --min-age {min_age:g} s: may be a save in progress)")
    for d in r.kept_live:
        typer.echo(f"kept {d} (its writer holds a lease: a save in progress)")
    for d in r.kept_referenced:
        typer.echo(f"kept {d} (a committed checkpoint references its frozen files)")
    for p, t in r.links:
        typer.echo(f"kept {p} (a symbolic link to {t}: clean neither follows nor removes links)")
    for u in r.uploads:
        state = "aborted" if u in r.aborted else "open"
        typer.echo(f"{state} multipart upload {u.key} ({u.upload_id})")
    typer.echo(f"{len(r.committed)} committed checkpoint(s) left alone; {len(r.debris)} debris "
               f"{'would be removed' if dry_run else 'removed'}, {len(r.aborted)} upload(s) aborted")
