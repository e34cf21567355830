"""A watch step run as a torchrun job (``processes = 2``): the same output as in the watcher's own
process, and exactly once when the job or the watcher is SIGKILLed mid-step.

The kill point is deterministic: a ``sitecustomize`` module put on the job's ``PYTHONPATH`` makes
rank 0 write a marker and pause where it would commit (every file written, no manifest yet),
while ``WATCH_JOB_PAUSE`` names the marker directory. Every wait has a timeout.
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
from testing.torchrun import ROOT, contents
from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import ConfigError
from shardckpt.storage import Storage
from shardckpt.tools.diff import diff
from shardckpt.watch.config import load_pipeline, parse_pipeline
from shardckpt.watch.records import checkpoint_dir
from shardckpt.watch.service import Watcher

psutil = pytest.importorskip("psutil")
pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow

CKPT = "step-00000100"
HEAD = """\
name = "j"
watch = "run"
state = "out"
backoff_s = 0.0
lease_ttl_s = 600
"""
SAME = HEAD + """\
retries = 0
[[steps]]
kind = "reshard"
dst = "out/one/{name}"
to = 3
[[steps]]
kind = "reshard"
dst = "out/two/{name}"
to = 3
processes = 2
"""
KILLED = HEAD + """\
retries = 1
[[steps]]
kind = "reshard"
dst = "out/two/{name}"
to = 3
processes = 2
"""
PAUSE_AT_COMMIT = """\
import os
if os.environ.get("RANK") == "0" and os.environ.get("WATCH_JOB_PAUSE"):
    import time
    from shardckpt.checkpoint.writer import CheckpointWriter

    def commit(self, *args, **kwargs):
        with open(os.path.join(os.environ["WATCH_JOB_PAUSE"], f"{os.getpid()}.paused"), "w"):
            pass
        while True:
            time.sleep(3600)

    CheckpointWriter.commit = commit
"""


def setup(tmp: Path, text: str) -> Path:
    make_run_dir(tmp / "run", (100,))
    path = tmp / "p.toml"
    path.write_text(text)
    return path


def done_records(tmp: Path) -> dict[str, dict]:
    d = tmp / "out" / checkpoint_dir("j", CKPT)
    return {p.name: json.loads(p.read_text()) for p in sorted(d.glob("*.done")) + sorted(d.glob("*.dead"))}


def wait_for(what: str, check, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's processes: one thread each, and a process group that gives up within a minute."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SHARDCKPT_DIST_TIMEOUT_S", "60")
    monkeypatch.delenv("SHARDCKPT_DIST", raising=False)


@pytest.mark.parametrize("step, needle", [
    ({"kind": "copy", "dst": "o/{name}", "processes": 2}, "steps[1] (copy): processes"),
    ({"kind": "retain", "keep": 2, "processes": 1}, "steps[1] (retain): processes"),
    ({"kind": "verify", "processes": 0}, "steps[1] (verify): processes = 0"),
    ({"kind": "reshard", "dst": "o/{name}", "to": 2, "processes": 1.5}, "processes = 1.5"),
    ({"kind": "consolidate", "dst": "o/{name}", "processes": True}, "processes = True"),
])
def test_processes_is_checked(step: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_pipeline({"name": "j", "watch": "run", "steps": [step]})
    assert needle in str(e.value)


def test_processes_defaults_to_one() -> None:
    p = parse_pipeline({"name": "j", "watch": "run", "steps": [
        {"kind": "verify"}, {"kind": "consolidate", "dst": "o/{name}", "processes": 3}]})
    assert [s.processes for s in p.steps] == [1, 3]


def test_job_of_two_writes_what_one_process_writes(tmp_path: Path, job_env: None) -> None:
    report = Watcher(load_pipeline(str(setup(tmp_path, SAME)))).run(once=True)
    assert (report.done, report.dead) == (2, 0)
    one, two = tmp_path / "out" / "one" / CKPT, tmp_path / "out" / "two" / CKPT
    assert contents(str(one)) == contents(str(two))
    assert diff(str(one), str(two)).equal
    recs = done_records(tmp_path)
    assert sorted(recs) == ["1-reshard.done", "2-reshard.done"]
    m = read_manifest(Storage(str(two)))
    assert recs["2-reshard.done"]["identity"] == m.save_id and m.mesh.world_size == 3
    assert recs["2-reshard.done"]["bytes"] == recs["1-reshard.done"]["bytes"] > 0


def test_killed_job_and_killed_watcher_leave_no_record_and_a_restart_finishes(
        tmp_path: Path, job_env: None) -> None:
    path = setup(tmp_path, KILLED)
    hook, markers = tmp_path / "hook", tmp_path / "markers"
    hook.mkdir()
    markers.mkdir()
    (hook / "sitecustomize.py").write_text(PAUSE_AT_COMMIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}
    cmd = [sys.executable, "-m", "shardckpt", "watch", str(path), "--once"]
    log1 = tmp_path / "watcher1.log"
    with open(log1, "wb") as err:
        w1 = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path,
                              env={**env, "WATCH_JOB_PAUSE": str(markers)})
    try:
        # the first try's job: rank 0 SIGKILLed where it would commit; the watcher retries
        first = wait_for("the first job to pause", lambda: sorted(markers.iterdir()))
        os.kill(int(first[0].name.split(".")[0]), signal.SIGKILL)
        second = wait_for("the retry's job to pause",
                          lambda: [p for p in markers.iterdir() if p not in first])
        # the watcher SIGKILLed while the retry's job runs: the job goes with it
        job = psutil.Process(w1.pid).children(recursive=True)
        assert any(p.pid == int(second[0].name.split(".")[0]) for p in job)
        w1.kill()
        w1.wait(timeout=60)
        _, alive = psutil.wait_procs(job, timeout=120)
        assert not alive, f"the job outlived its watcher: {alive}"
    finally:
        if w1.poll() is None:
            w1.kill()
            w1.wait(timeout=60)
    assert done_records(tmp_path) == {}
    out = tmp_path / "out" / "two" / CKPT
    assert not (out / "manifest.json").exists()
    lines = log1.read_text().splitlines()
    assert any(f"{CKPT} 1-reshard: " in line for line in lines)  # the job's stderr, prefixed
    failed = [line for line in lines if f"{CKPT} 1-reshard (try 1 of 2): StepFailed:" in line]
    assert len(failed) == 1 and "torchrun job of 2 processes" in failed[0], lines[-40:]

    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = done_records(tmp_path)
    assert list(recs) == ["1-reshard.done"] and recs["1-reshard.done"]["tries"] == 1
    m = read_manifest(Storage(str(out)))
    assert recs["1-reshard.done"]["identity"] == m.save_id and verify(str(out))
    # one committed output: the killed attempts' directories were removed when it committed
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", m.save_id])


def test_a_failed_job_is_one_line() -> None:
    from shardckpt.watch.job import _failure, _root_cause

    assert _failure(1, ["reshard: committing: lost contact", "other", "other"], 2) == \
        "reshard: committing: lost contact (and 1 more) (torchrun job of 2 processes, exit status 1)"
    cause = _root_cause(["Root Cause (first observed failure):", "[0]:", "host      : h",
                         "rank      : 0 (local_rank: 0)", "exitcode  : -9 (pid: 7)  (SIGKILL)"])
    assert cause == "rank 0 (local_rank: 0) of the job failed (exitcode -9 (pid: 7) (SIGKILL))"
    assert "killed by SIGTERM" in _failure(-15, [], 2)
