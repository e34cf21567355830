"""`shardckpt watch`: run a checkpoint pipeline (TOML) once for every committed checkpoint."""

from __future__ import annotations

from typing import Optional

import typer

from shardckpt.cli.app import app
from shardckpt.cli.common import EXIT_FAILED, EXIT_USAGE, echo, echo_json, fail, guarded


@app.command()
@guarded
def watch(
    pipeline: str = typer.Argument(..., help="The pipeline's TOML file (see README: Pipelines)."),
    once: bool = typer.Option(False, "--once", help="Process the committed checkpoints there are, "
                              "then exit (for cron and CI); exit 1 if a step was dead-lettered "
                              "or a checkpoint waits behind an unreadable record."),
    status: bool = typer.Option(False, "--status", help="Print each checkpoint and its steps' "
                                "states, then exit."),
    json_out: bool = typer.Option(False, "--json", help="With --status: print JSON."),
    serve: Optional[int] = typer.Option(None, "--serve", min=0, max=65535,
                                        help="Serve the status (HTML at /, /status.json, /metrics "
                                             "for Prometheus) on 127.0.0.1:PORT while watching."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log warnings only."),
) -> None:
    """Verify, reshard, consolidate, copy and prune every checkpoint of a run, each step exactly once."""
    import logging

    from shardckpt.watch.service import Watcher
    from shardckpt.watch.config import load_pipeline
    from shardckpt.watch.status import pipeline_status, status_lines

    if json_out and not status:
        fail("--json goes with --status", EXIT_USAGE)
    if status and (once or serve is not None):
        fail("--status prints and exits; it does not combine with --once or --serve", EXIT_USAGE)
    p = load_pipeline(pipeline)
    if status:
        doc = pipeline_status(p)
        if json_out:
            echo_json(doc)
        else:
            for line in status_lines(doc):
                echo(line)
        return
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    w = Watcher(p)
    server = None
    if serve is not None:
        from shardckpt.watch.http import serve as start_server

        server = start_server(serve, lambda: pipeline_status(p, w.watch, w.state), w.counters)
        echo(f"serving the status of {p.name} on http://127.0.0.1:{server.server_address[1]}/", err=True)
    try:
        report = w.run(once=once)
    finally:
        w.stop()
        if server is not None:
            server.shutdown()
    if once:
        unreadable = f", {report.unreadable} waiting behind an unreadable record (see the log)" \
            if report.unreadable else ""
        echo(f"{report.done} step(s) done, {report.dead} dead-lettered, {report.held} checkpoint(s) "
             f"held by another watcher, {report.uncommitted} not committed{unreadable}")
        if report.dead or report.unreadable:
            raise typer.Exit(EXIT_FAILED)
