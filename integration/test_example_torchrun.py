"""integration/example_train.py (the README's tour loop, with arguments) under torchrun, then
resumed on another world size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(os.path.dirname(__file__), "example_train.py")


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", EXAMPLE, *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_example_trains_saves_and_resumes_on_more_ranks(tmp_path):
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.checkpoint.verify import verify
    from shardckpt.checkpoint.run_dir import CheckpointManager

    run = str(tmp_path / "run")
    r = torchrun(2, "--ckpt-dir", run, "--steps", "4", "--save-every", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    mgr = CheckpointManager(run)
    assert [f.step for f in mgr.committed()] == [2, 4] and mgr.read_latest() == "step-00000004"
    r = torchrun(3, "--ckpt-dir", run, "--steps", "6", "--save-every", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 4 loss" in r.stderr and "step 3 loss" not in r.stderr  # resumed at step 4
    assert [f.step for f in mgr.committed()] == [4, 6]  # keep_last=2
    result = verify(mgr.url_for(6))
    assert result, result.problems
    extras = CheckpointReader(mgr.url_for(6)).manifest.extras
    assert extras["app"]["data"]["samples_seen"] == 6 * 12  # the same global batch throughout
    # the same --steps again: nothing left to do, and it says so
    r = torchrun(3, "--ckpt-dir", run, "--steps", "6", "--save-every", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint at step 6 already reached --steps 6; nothing to train" in r.stderr
    assert " loss " not in r.stderr and [f.step for f in mgr.committed()] == [4, 6]


def test_example_refuses_a_global_batch_the_ranks_cannot_split(tmp_path):
    r = torchrun(2, "--ckpt-dir", str(tmp_path / "run"), "--global-batch", "5")
    assert r.returncode != 0
    assert "--global-batch 5 does not split evenly over 2 ranks" in r.stderr, r.stderr[-3000:]
    assert not os.path.exists(tmp_path / "run")
