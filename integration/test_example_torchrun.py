"""The README's training-loop example, launched with torchrun, then resumed on another world size."""

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
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_example_trains_saves_and_resumes(tmp_path):
    from shardckpt.checkpoint import verify
    from shardckpt.manager import CheckpointManager

    run = str(tmp_path / "run")
    r = torchrun(2, "--ckpt-dir", run, "--steps", "4", "--save-every", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    mgr = CheckpointManager(run)
    assert [f.step for f in mgr.committed()] == [2, 4] and mgr.read_latest() == "step-00000004"
    r = torchrun(1, "--ckpt-dir", run, "--steps", "6", "--save-every", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 4 loss" in r.stderr and "step 3 loss" not in r.stderr  # resumed at step 4
    assert [f.step for f in mgr.committed()] == [4, 6]  # keep_last=2
    _, reports, problems = verify(mgr.url_for(6))
    assert not problems and all(x.ok for x in reports)
