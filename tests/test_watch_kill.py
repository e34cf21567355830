"""`shardckpt watch` as real processes: SIGKILL at fixed points of a step, restart, and check that
every step ran to completion exactly once; two watchers on one pipeline share the work.

The kill points are made deterministic by the child itself: its entry (below) wraps library
functions before running the CLI, writes a marker file when it reaches the chosen point and
pauses there until the test kills it. Every completed step appends a line to a log, so a step
that committed twice shows up twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testing.ckpts import make_run_dir
from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.verify import verify
from shardckpt.storage import Storage
from shardckpt.watch.records import checkpoint_dir

CHILD = r'''
import json, os, sys, time
from shardckpt.watch import records as watch_records
from shardckpt.watch import steps as watch_steps
from shardckpt.cli.main import app

pipeline, point, log, markers = sys.argv[1:5]
kind, where = point.split(":") if point != "-" else ("", "")


def pause(tag):
    with open(os.path.join(markers, f"{os.getpid()}.{tag}"), "w"):
        pass
    while True:
        time.sleep(3600)


real_run = watch_steps.run_step
def run_step(ctx):
    if ctx.spec.kind == kind and where == "claimed":
        pause("reached")
    if where == "rendezvous":  # hold the first claim until the other watcher holds one too
        with open(os.path.join(markers, f"{os.getpid()}.claimed"), "w"):
            pass
        for _ in range(6000):
            if len([n for n in os.listdir(markers) if n.endswith(".claimed")]) >= 2:
                break
            time.sleep(0.01)
    facts = real_run(ctx)
    with open(log, "a") as f:
        f.write(json.dumps([ctx.checkpoint, ctx.spec.key, os.getpid(), facts.get("identity")]) + "\n")
    return facts
watch_steps.run_step = run_step

if where == "midstep":
    from shardckpt.storage import Storage
    from shardckpt.checkpoint.writer import CheckpointWriter
    real_put, real_create, real_commit = Storage.put, Storage.create_only, CheckpointWriter.commit
    def put(self, rel, data):
        if kind == "consolidate" and rel == "model.safetensors.index.json":
            pause("reached")
        return real_put(self, rel, data)
    def create_only(self, rel, data):
        if kind == "copy" and rel == "manifest.json" and "/copy/" in self.url:
            pause("reached")
        return real_create(self, rel, data)
    def commit(self, *a, **k):
        if kind == "reshard":
            pause("reached")
        return real_commit(self, *a, **k)
    Storage.put, Storage.create_only, CheckpointWriter.commit = put, create_only, commit

real_done = watch_records.write_done
def write_done(storage, pipeline_name, checkpoint, key, doc):
    if key.endswith(kind) and where == "committed":
        pause("reached")
    out = real_done(storage, pipeline_name, checkpoint, key, doc)
    if key.endswith(kind) and where == "recorded":
        pause("reached")
    return out
watch_records.write_done = write_done

try:
    app(["watch", pipeline, "--once", "-q"])
except SystemExit as e:
    sys.exit(e.code)
'''

PIPELINE = """\
name = "k"
watch = "run"
state = "out"
retries = 0
lease_ttl_s = 600
[[steps]]
kind = "verify"
[[steps]]
kind = "reshard"
dst = "out/ws3/{name}"
to = 3
[[steps]]
kind = "consolidate"
dst = "out/hf/{name}"
[[steps]]
kind = "copy"
dst = "out/copy/{name}"
"""
KEYS = ["1-verify", "2-reshard", "3-consolidate", "4-copy"]
OUTPUTS = {"2-reshard": "ws3", "3-consolidate": "hf", "4-copy": "copy"}


def setup(tmp: Path, steps: tuple[int, ...]) -> Path:
    make_run_dir(tmp / "run", steps)
    (tmp / "markers").mkdir()
    path = tmp / "p.toml"
    path.write_text(PIPELINE)
    return path


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_children():
    """Whatever a test leaves running (a failed wait, a paused child) is killed and reaped."""
    try:
        yield
    finally:
        while _started:
            proc = _started.pop()
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=120)


def start(tmp: Path, pipeline: Path, point: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(pipeline), point, str(tmp / "log"),
                             str(tmp / "markers")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _started.append(proc)
    return proc


def wait_marker(tmp: Path, proc: subprocess.Popen, tag: str) -> None:
    marker = tmp / "markers" / f"{proc.pid}.{tag}"
    for _ in range(30000):  # a bound on a hang, not a timing assertion
        if marker.exists():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the watcher exited ({proc.returncode}) before {tag}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"the watcher never reached {tag}")


def finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


def log_lines(tmp: Path) -> list[list]:
    path = tmp / "log"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def check_exactly_once(tmp: Path, names: list[str]) -> None:
    """Every step of every checkpoint has one .done record; every output step's work completed
    once (the log; a kill after its commit leaves it to be adopted, not redone), and its output
    is the recorded one and verifies."""
    ran: dict[tuple[str, str], int] = {}
    for ckpt, key, _, _ in log_lines(tmp):
        ran[(ckpt, key)] = ran.get((ckpt, key), 0) + 1
    for name in names:
        d = tmp / "out" / checkpoint_dir("k", name)
        assert sorted(p.name for p in d.glob("*.done")) == [f"{k}.done" for k in KEYS], name
        assert not list(d.glob("*.dead"))
        for key, sub in OUTPUTS.items():
            rec = json.loads((d / f"{key}.done").read_text())
            n = ran.get((name, key), 0)
            assert n == 1, (name, key, n, rec)  # a kill after the commit: adopted, not redone
            out = tmp / "out" / sub / name
            if key != "3-consolidate":
                assert verify(str(out))
                assert read_manifest(Storage(str(out))).save_id == rec["identity"]
            else:
                prov = json.loads((out / "shardckpt_consolidated.json").read_text())
                assert prov["save_id"] == rec["identity"]
                assert not [p for p in out.iterdir() if ".partial-" in p.name]
        ws3 = tmp / "out" / "ws3" / name
        saves = [p for p in ws3.iterdir() if p.is_dir()]
        assert len(saves) == 1, saves  # the killed attempt's directory was removed


@pytest.mark.parametrize("point", ["verify:claimed", "verify:recorded", "reshard:claimed",
                                   "reshard:midstep", "reshard:committed", "consolidate:midstep",
                                   "consolidate:committed", "copy:midstep", "copy:committed"])
def test_sigkill_mid_step_then_restart_is_exactly_once(tmp_path: Path, point: str) -> None:
    pipeline = setup(tmp_path, (100,))
    proc = start(tmp_path, pipeline, point)
    wait_marker(tmp_path, proc, "reached")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    finish(start(tmp_path, pipeline, "-"))
    check_exactly_once(tmp_path, ["step-00000100"])
    if point.endswith("committed") and not point.startswith("verify"):
        key = {"reshard": "2-reshard", "consolidate": "3-consolidate", "copy": "4-copy"}[point.split(":")[0]]
        rec = json.loads((tmp_path / "out" / checkpoint_dir("k", "step-00000100") / f"{key}.done").read_text())
        assert rec["adopted"] is True


def test_two_watchers_share_the_work_without_doubling(tmp_path: Path) -> None:
    names = [f"step-{s:08d}" for s in (100, 200, 300, 400)]
    pipeline = setup(tmp_path, (100, 200, 300, 400))
    a = start(tmp_path, pipeline, "-:rendezvous")
    b = start(tmp_path, pipeline, "-:rendezvous")
    finish(a)
    finish(b)
    check_exactly_once(tmp_path, names)
    pids = {pid for _, _, pid, _ in log_lines(tmp_path)}
    assert pids == {a.pid, b.pid}  # both did work: each held a claim while the other chose
    assert len(log_lines(tmp_path)) == len(names) * len(KEYS)
    assert os.path.exists(tmp_path / "log")
