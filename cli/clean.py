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
    keep_last: int | None = typer.Option(None, "--keep-last", min=1,
                                         help="Retention first: keep the newest N checkpoints of "
                                              "the run directory PREFIX, delete older ones."),
    keep_optimizer_last: int | None = typer.Option(
        None, "--keep-optimizer-last", min=1,
        help="Of the kept checkpoints, the newest N keep their optimizer state; older ones are "
             "thinned in place into weights-only checkpoints."),
    keep_every: int | None = typer.Option(None, "--keep-every", min=1,
                                          help="Also keep (weights) every checkpoint whose step is "
                                               "a multiple of K."),
) -> None:
    """Remove save directories no manifest names; abort multipart uploads left open. With
    --keep-last / --keep-optimizer-last / --keep-every, first apply that retention to the run
    directory PREFIX (older checkpoints deleted, or thinned into weights only).

    Nothing outside PREFIX is touched: symbolic links below it are reported, never followed
    or removed."""
    from shardckpt.checkpoint.retention import RetentionPolicy
    from shardckpt.checkpoint.run_retention import retain_run
    from shardckpt.tools.clean import clean as run

    options = parse_storage_options(storage_option)
    policy = RetentionPolicy(keep_last, keep_optimizer_last, keep_every)
    kept = retain_run(prefix, policy, dry_run, options) if policy.active else None
    r = run(prefix, dry_run=dry_run, min_age_s=min_age, storage_options=options)
    retention = None if kept is None else {
        "removed": kept.removed, "thinned": kept.thinned, "kept_referenced": kept.kept_referenced,
        "not_thinned": kept.skipped}
    if json_out:
        echo_json({"prefix": prefix, "dry_run": dry_run, "debris": r.debris, "kept_young": r.kept_young,
                   "kept_live": r.kept_live, "kept_referenced": r.kept_referenced,
                   "committed": r.committed,
                   "links": [{"path": p, "target": t} for p, t in r.links],
                   "open_uploads": [{"key": u.key, "upload_id": u.upload_id, "initiated": u.initiated}
                                    for u in r.uploads],
                   "aborted_uploads": [u.key for u in r.aborted],
                   **({"retention": retention} if retention is not None else {})})
        return
    verb = "would remove" if dry_run else "removed"
    if kept is not None:
        for u in kept.removed:
            typer.echo(f"{verb} checkpoint {u} (retention)")
        for u in kept.thinned:
            typer.echo(f"{'would thin' if dry_run else 'thinned'} {u} into weights only (retention)")
        for line in kept.skipped:
            typer.echo(f"kept whole {line}")
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
