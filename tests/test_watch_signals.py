"""`shardckpt watch` stops gracefully on SIGTERM and on SIGINT, even when it was started with
SIGINT ignored (``nohup``, ``cmd &`` in a non-interactive shell): the step in flight finishes and
is recorded, no other starts, and it exits 0; a second signal exits at once, non-zero.

The watcher runs as a child process with SIGINT ignored, as those shells leave it. The test
waits for its log lines (read as they come, each wait bounded to fail rather than hang) and, for
a step in flight, holds the step at a marker file until the signal has been taken."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from testing.ckpts import make_run_dir
from shardckpt.watch.records import checkpoint_dir

WAIT_S = 120  # a bound on a hang, not a timing assertion

PIPELINE = """\
name = "sig"
watch = "run"
state = "out"
retries = 0
interval_s = 0.2
[[steps]]
kind = "verify"
[[steps]]
kind = "copy"
dst = "out/copy/{name}"
"""

#: The watcher's entry: the CLI, with the first step of each checkpoint held until ``go`` exists
#: (when the argument is "hold"), after writing ``held`` beside it.
CHILD = r'''
import os, sys, time
from shardckpt.watch import steps as watch_steps
from shardckpt.cli.main import app

pipeline, mode, markers = sys.argv[1:4]
real_run = watch_steps.run_step

def run_step(ctx):
    if mode == "hold" and ctx.spec.kind == "verify":
        open(os.path.join(markers, "held"), "w").close()
        while not os.path.exists(os.path.join(markers, "go")):
            time.sleep(0.01)
    return real_run(ctx)

watch_steps.run_step = run_step
app(["watch", pipeline])
'''


def ignore_sigint() -> None:
    """In the child before exec: SIGINT ignored, as nohup and background jobs have it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Lines:
    """A child's stderr, read line by line on a thread, so that a wait can be bounded."""

    def __init__(self, stream) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, pattern: str) -> str:
        while True:
            try:
                line = self.q.get(timeout=WAIT_S)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r}: {self.seen}") from None
            if line is None:
                raise AssertionError(f"the watcher's stderr ended before {pattern!r}: {self.seen}")
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def rest(self) -> list[str]:
        self.thread.join(timeout=WAIT_S)
        while True:
            try:
                line = self.q.get_nowait()
            except queue.Empty:
                return self.seen
            if line is not None:
                self.seen.append(line)


def setup(tmp: Path) -> Path:
    make_run_dir(tmp / "run", (100,))
    (tmp / "markers").mkdir()
    path = tmp / "p.toml"
    path.write_text(PIPELINE)
    return path


def records(tmp: Path) -> list[str]:
    d = tmp / "out" / checkpoint_dir("sig", "step-00000100")
    return sorted(p.name for p in d.glob("*.d*")) if d.exists() else []


@pytest.fixture
def watcher(tmp_path: Path) -> Iterator:
    """Starts watchers with SIGINT ignored; kills whatever is still running at the end."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, Lines]:
        proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=ignore_sigint, cwd=tmp_path)
        started.append(proc)
        return proc, Lines(proc.stderr)

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=WAIT_S)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_idle_watcher_stops_on_the_signal_and_exits_0(tmp_path: Path, watcher, sig) -> None:
    pipeline = setup(tmp_path)
    proc, lines = watcher(sys.executable, "-m", "shardckpt.cli.main", "watch", str(pipeline))
    lines.wait_for(r"watching .*run for pipeline sig")
    lines.wait_for(r"step-00000100 2-copy done")  # idle from here on
    proc.send_signal(sig)
    assert proc.wait(timeout=WAIT_S) == 0, lines.rest()
    rest = lines.rest()
    assert any(f"stopped on {sig.name}" in line for line in rest), rest
    assert not any("Traceback" in line for line in rest), rest
    assert records(tmp_path) == ["1-verify.done", "2-copy.done"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_step_in_flight_finishes_and_no_other_starts(tmp_path: Path, watcher, sig) -> None:
    pipeline = setup(tmp_path)
    markers = tmp_path / "markers"
    proc, lines = watcher(sys.executable, "-c", CHILD, str(pipeline), "hold", str(markers))
    lines.wait_for(r"watching ")
    for _ in range(WAIT_S * 100):  # the step is held at its marker
        if (markers / "held").exists() or proc.poll() is not None:
            break
        threading.Event().wait(0.01)
    assert (markers / "held").exists(), lines.rest()
    proc.send_signal(sig)
    lines.wait_for(rf"{sig.name}: stopping once the step in flight is recorded")
    (markers / "go").touch()
    assert proc.wait(timeout=WAIT_S) == 0, lines.rest()
    rest = lines.rest()
    assert any(f"stopped on {sig.name}" in line for line in rest), rest
    # the step in flight is recorded; the next one never started (no claim of it either)
    assert records(tmp_path) == ["1-verify.done"]
    assert not (tmp_path / "out" / checkpoint_dir("sig", "step-00000100") / "2-copy").exists()
    assert not (tmp_path / "out" / "copy").exists()


def test_a_second_signal_during_the_stop_exits_at_once(tmp_path: Path, watcher) -> None:
    pipeline = setup(tmp_path)
    markers = tmp_path / "markers"
    proc, lines = watcher(sys.executable, "-c", CHILD, str(pipeline), "hold", str(markers))
    lines.wait_for(r"watching ")
    for _ in range(WAIT_S * 100):
        if (markers / "held").exists() or proc.poll() is not None:
            break
        threading.Event().wait(0.01)
    assert (markers / "held").exists(), lines.rest()
    proc.send_signal(signal.SIGTERM)
    lines.wait_for(r"SIGTERM: stopping")
    proc.send_signal(signal.SIGINT)  # ignored when it started; handled now
    assert proc.wait(timeout=WAIT_S) == 128 + signal.SIGINT, lines.rest()
    assert any("SIGINT during the stop: exiting now" in line for line in lines.rest())
    assert records(tmp_path) == []  # the held step was abandoned, unrecorded


def test_a_watcher_started_again_redoes_the_abandoned_step(tmp_path: Path, watcher) -> None:
    """After an exit at once, the next watcher takes the step over (its lease ended with the
    process on this host) and records every step once."""
    test_a_second_signal_during_the_stop_exits_at_once(tmp_path, watcher)
    proc, lines = watcher(sys.executable, "-m", "shardckpt.cli.main", "watch", str(tmp_path / "p.toml"),
                          "--once")
    assert proc.wait(timeout=WAIT_S) == 0, lines.rest()
    assert records(tmp_path) == ["1-verify.done", "2-copy.done"]
