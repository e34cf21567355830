"""`shardckpt watch`: run a checkpoint pipeline (TOML) once for every committed checkpoint."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any
from collections.abc import Iterator

import typer

from .app import app
from .common import EXIT_FAILED, EXIT_USAGE, echo, echo_json, fail, guarded

log = logging.getLogger("shardckpt.watch")

#: The signals that stop a watcher gracefully: a service manager's stop, and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@app.command()
@guarded
def watch(
    pipeline: str = typer.Argument(..., help="The pipeline's TOML file (see docs/pipelines.md)."),
    once: bool = typer.Option(False, "--once", help="Process the committed checkpoints there are, "
                              "then exit (for cron and CI); exit 1 if a step was dead-lettered, "
                              "a checkpoint waits behind an unreadable record, or there is no "
                              "checkpoint at all (unless --allow-empty)."),
    status: bool = typer.Option(False, "--status", help="Print each checkpoint and its steps' "
                                "states, then exit."),
    json_out: bool = typer.Option(False, "--json", help="With --status: print JSON."),
    serve: int | None = typer.Option(None, "--serve", min=0, max=65535,
                                        help="Serve the status (HTML at /, /status.json, /metrics "
                                             "for Prometheus) on 127.0.0.1:PORT while watching."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log warnings only."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log DEBUG too: a failed torchrun "
                                 "job's tracebacks and torchrun's failure report."),
    allow_empty: bool = typer.Option(False, "--allow-empty", help="With --once: exit 0 when the "
                                     "watched prefix holds no checkpoint (it warns either way)."),
    redrive: str | None = typer.Option(None, "--redrive", metavar="CHECKPOINT",
                                       help="Run the dead-lettered step of CHECKPOINT (a name "
                                            "such as step-00000100) again, then exit; its .dead "
                                            "record is kept beside as <key>.dead.<n>."),
    step: str | None = typer.Option(None, "--step", metavar="STEP",
                                    help="With --redrive: the step to run again (2-reshard, "
                                         "reshard or 2) where the checkpoint has several."),
) -> None:
    """Verify, reshard, consolidate, copy and prune every checkpoint of a run, each step exactly once.

    SIGTERM or SIGINT (Ctrl-C) stops it: the step in flight finishes and is recorded, no other
    starts, a step waiting to retry is left unrecorded (its claim released, for the next watcher),
    and it exits 0; a second signal exits at once (128 + the signal's number), leaving the step
    in flight to be redone or adopted by the next watcher. A step with `processes` > 1 runs as a
    torchrun job: the first signal lets it finish, a second terminates it."""
    from shardckpt.watch.service import Watcher
    from shardckpt.watch.config import load_pipeline
    from shardckpt.watch.status import pipeline_status, status_lines

    _check_flags(json_out, status, once, serve, redrive, step, quiet, verbose)
    p = load_pipeline(pipeline)
    if status:
        doc = pipeline_status(p)
        if json_out:
            echo_json(doc)
        else:
            for line in status_lines(doc):
                echo(line)
        return
    logging.basicConfig(level=logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    w = Watcher(p)
    if redrive is not None:
        _redrive(w, redrive, step)
        return
    server = None
    if serve is not None:
        from shardckpt.watch.http import serve as start_server

        server = start_server(serve, lambda: pipeline_status(p, w.watch, w.state), w.counters)
        echo(f"serving the status of {p.name} on http://127.0.0.1:{server.server_address[1]}/", err=True)
    try:
        with stop_on_signals(w.stop) as received:
            report = w.run(once=once)
    finally:
        w.stop()
        if server is not None:
            server.shutdown()
    if received:
        echo(f"stopped on {received[0]}", err=True)
    if once:
        _report_once(report, allow_empty)


def _check_flags(json_out: bool, status: bool, once: bool, serve: int | None, redrive: str | None,
                 step: str | None, quiet: bool, verbose: bool) -> None:
    """The combinations of ``watch``'s flags that mean nothing: a usage error each."""
    if json_out and not status:
        fail("--json goes with --status", EXIT_USAGE)
    if status and (once or serve is not None):
        fail("--status prints and exits; it does not combine with --once or --serve", EXIT_USAGE)
    if step is not None and redrive is None:
        fail("--step goes with --redrive", EXIT_USAGE)
    if redrive is not None and (status or once or serve is not None):
        fail("--redrive runs one checkpoint and exits; it does not combine with --status, "
             "--once or --serve", EXIT_USAGE)
    if quiet and verbose:
        fail("--quiet and --verbose contradict each other", EXIT_USAGE)


def _redrive(w: Any, checkpoint: str, step: str | None) -> None:
    """``--redrive``: run the dead-lettered step again; exit 1 unless every step is done."""
    from shardckpt.watch.redrive import redrive

    outcome = redrive(w, checkpoint, step)
    echo(f"{checkpoint}: {outcome.done} step(s) done, {outcome.dead} dead-lettered again")
    if outcome.dead or outcome.unreadable or outcome.held or outcome.skipped:
        raise typer.Exit(EXIT_FAILED)


def _report_once(report: Any, allow_empty: bool) -> None:
    """The summary line of ``--once``, and its exit status."""
    unreadable = f", {report.unreadable} waiting behind an unreadable record (see the log)" \
        if report.unreadable else ""
    skipped = f", {report.skipped} removed before processing (skipped)" if report.skipped else ""
    echo(f"{report.done} step(s) done, {report.dead} dead-lettered, {report.held} checkpoint(s) "
         f"held by another watcher, {report.uncommitted} not committed{unreadable}{skipped}")
    if not report.found and not allow_empty:
        echo("error: no checkpoint to watch (see the warning above); pass --allow-empty "
             "where an empty run is expected", err=True)
        raise typer.Exit(EXIT_FAILED)
    if report.dead or report.unreadable:
        raise typer.Exit(EXIT_FAILED)


@contextmanager
def stop_on_signals(stop: Any) -> Iterator[list[str]]:
    """While the block runs, SIGTERM and SIGINT call ``stop`` (once); a second one ends the
    process at once with status 128 + its number. Yields the names of the signals received.

    The handlers are installed whatever the signals' dispositions were, so a watcher started
    with SIGINT ignored (``nohup``, ``cmd &`` in a non-interactive shell) still stops on it;
    they are restored on the way out. A handler only writes the signal's number to a pipe: a
    thread reads it and does the rest, so nothing that takes a lock runs inside a handler (the
    main thread may hold that lock where the signal interrupts it). Off the main thread, where
    handlers cannot be installed, this does nothing."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def handler(signum: int, frame: Any) -> None:
        try:
            os.write(write_fd, bytes([signum]))
        except OSError:  # the pipe is full of signals already: one more changes nothing
            pass

    def react() -> None:
        while True:
            try:
                data = os.read(read_fd, 1)
            except OSError:
                return
            if not data:
                return
            name = signal.Signals(data[0]).name
            if received:
                log.error("%s during the stop: exiting now; the step in flight is left to the "
                          "next watcher (its lease ends with this process, and a torchrun job "
                          "running it is terminated)", name)
                from shardckpt.watch.job import terminate_all

                terminate_all()
                sys.stderr.flush()
                os._exit(128 + data[0])
            received.append(name)
            log.warning("%s: stopping once the step in flight is recorded; no other step starts "
                        "(%s again exits at once)", name, name)
            stop()

    reader = threading.Thread(target=react, name="shardckpt-watch-signals", daemon=True)
    reader.start()
    previous = {}
    try:
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, handler)
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(write_fd)
        reader.join()
        os.close(read_fd)
