"""`shardckpt demo`: train, save, reshard, resume, consolidate, check — on local disk."""

from __future__ import annotations


import typer

from .app import app
from .common import echo_json, guarded, human_bytes


@app.command()
@guarded
def demo(
    workdir: str | None = typer.Option(None, "--workdir", help="Empty directory for the files (default: a new temp dir)."),
    ranks: int = typer.Option(4, "--ranks", help="World size of the first training job."),
    to: int = typer.Option(2, "--to", help="World size to reshard to and resume on."),
    steps: int = typer.Option(4, "--steps", help="Training steps in each of the two jobs."),
    keep: bool | None = typer.Option(None, "--keep/--no-keep",
                                        help="Keep the files at the end, or remove them. Default: "
                                             "remove the temp dir the demo made, keep a --workdir."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Train a small Llama with ZeRO-3 on N processes, save, reshard N->M, resume on M, consolidate,
    and check that a plain module's loss on the consolidated weights equals the sharded one's."""
    from shardckpt.demo import run_demo

    say = (lambda line: None) if json_out else (lambda line: typer.echo(f"- {line}"))
    s = run_demo(workdir, ranks, to, steps, say=say, keep=keep)
    if json_out:
        echo_json(s.to_dict())
        return
    for p in s.phases:
        losses = ", ".join(f"{x:.4f}" for x in p["losses"])
        typer.echo(f"  {p['ranks']} ranks, steps {p['start']}..{p['start'] + len(p['losses']) - 1}: "
                   f"loss {losses}; samples seen {p['samples_seen']}, lr {p['lr']:.2e}")
    typer.echo(f"  checkpoint {human_bytes(s.sizes['checkpoint_bytes'])}, consolidated "
               f"{human_bytes(s.sizes['consolidated_bytes'])}")
    typer.echo("  times: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in s.times.items()))
    typer.echo(f"  named-batch loss: sharded {s.sharded_loss!r}, plain module {s.plain_loss!r} "
               f"({'bit for bit equal' if s.bit_exact else 'DIFFERENT'})")
    if s.kept:
        typer.echo("  files:")
        for k, v in s.paths.items():
            typer.echo(f"    {k}: {v}")
    typer.echo(f"- {s.cleanup}")
