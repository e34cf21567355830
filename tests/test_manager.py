"""Checkpoint manager: step directories, the latest pointer, retention, resume."""

from __future__ import annotations

import os

import pytest

from shardckpt.errors import IncompleteCheckpointError, ShardckptError
from shardckpt.checkpoint.run_dir import CheckpointManager, step_dir
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.synth import synthesize


def save(mgr: CheckpointManager, step: int) -> None:
    synthesize(mgr.url_for(step), 20_000, ranks=2, units=1, step=step)
    mgr.mark_committed(step)


def test_latest_retention_and_resume(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=2)
    for step in (100, 200, 300):
        save(mgr, step)
    assert [f.step for f in mgr.committed()] == [200, 300]
    assert mgr.read_latest() == step_dir(300)
    assert mgr.resume_point().step == 300


def test_uncommitted_directory_is_skipped(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=3)
    save(mgr, 100)
    # a save of step 200 that never committed: shards but no manifest
    synthesize(mgr.url_for(200), 20_000, ranks=2, units=1)
    os.remove(os.path.join(mgr.url_for(200), MANIFEST_NAME))
    assert mgr.resume_point().step == 100
    with pytest.raises(IncompleteCheckpointError, match="latest is not moved"):
        mgr.mark_committed(200)
    assert mgr.read_latest() == step_dir(100)


def test_damaged_newest_is_skipped_on_resume(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    save(mgr, 1)
    save(mgr, 2)
    m = os.path.join(mgr.url_for(2))
    shard = next(os.path.join(r, f) for r, _, fs in os.walk(m) for f in fs if f.startswith("shard-"))
    with open(shard, "ab") as f:
        f.write(b"x")
    assert mgr.resume_point().step == 1
    # a flipped byte keeps the size: only the full check sees it
    save(mgr, 3)
    shard = next(os.path.join(r, f) for r, _, fs in os.walk(mgr.url_for(3)) for f in fs
                 if f.startswith("shard-"))
    with open(shard, "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 1]))
    assert mgr.resume_point().step == 3
    assert mgr.resume_point(full_verify=True).step == 1


def test_retention_never_deletes_newest_committed(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=1)
    save(mgr, 5)
    save(mgr, 6)
    assert [f.step for f in mgr.committed()] == [6]
    with pytest.raises(ShardckptError, match="keep_last"):
        CheckpointManager(str(tmp_path), keep_last=0)


def test_empty_run(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "nothing"))
    assert mgr.committed() == [] and mgr.resume_point() is None and mgr.read_latest() is None
