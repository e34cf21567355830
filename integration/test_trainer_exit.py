"""A ``ShardckptTrainer`` run that succeeded exits 0: no SIGABRT at interpreter teardown.

A gloo process group alive at teardown aborts the process now and then ("terminate called
without an active exception", exit -6; :mod:`shardckpt.integrations.teardown`). The job most
exposed is a script that ends with ``trainer.train()``: Trainer's last all-gather comes
milliseconds before the interpreter shuts down. Measured before the fix on this 2-core machine
with this job (2 ranks, 2 steps, one save): 1 abort in 20 launches; the issue saw 2 in 21.

:data:`LAUNCHES` launches under ``torchrun`` (a normal interpreter exit: ``testing.ranks``
children end with ``os._exit``, which would hide it), 2 side by side. The claim rests on the
cause, checked on every launch: each rank's first atexit hook (run last) records whether a
process group is still alive when teardown begins; it must not be. On the old code it was alive
in every launch, so any one launch fails if it comes back. The symptom is watched too: an abort
that hits 1 launch in 10 shows in at least one of them with probability 1 - 0.9 ** 12 = 72 %
(30 launches, 96 %, took a fifth of the suite's time on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from testing.torchrun import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LAUNCHES = 12
MISS_CHANCE = 0.9 ** LAUNCHES  # a 1-in-10 abort unseen by every launch (the cause: seen by any)
TIMEOUT_S = 300


def _launch(root: Path, i: int) -> tuple[int, str]:
    """One 2-rank Trainer run ending with ``train()``: (torchrun's exit status, its output)."""
    out = root / str(i)
    spec = {"results": str(out / "results"), "runs": [
        {"steps": 2, "save_steps": 2, "batch": 2, "bare": True, "output_dir": str(out / "run")}]}
    path = root / f"spec-{i}.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "testing.trainer_job", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    committed = (out / "run" / "checkpoint-2" / "manifest.json").exists()
    alive = [json.loads((out / "results/0" / f"exit-rank-{r}.json").read_text())["group_alive"]
             for r in (0, 1) if (out / "results/0" / f"exit-rank-{r}.json").exists()]
    if alive != [False, False]:  # the cause, seen on every launch: the group left to teardown
        return -2, f"process group alive when teardown began (ranks 0, 1): {alive}\n{done.stderr}"
    return (done.returncode if committed else -1), done.stderr


def test_a_run_that_succeeded_never_aborts_at_exit(tmp_path: Path) -> None:
    assert MISS_CHANCE < 0.3
    with ThreadPoolExecutor(2) as pool:  # two launches at a time: 4 ranks on the machine
        results = list(pool.map(lambda i: _launch(tmp_path, i), range(LAUNCHES)))
    failed = [(i, code, err) for i, (code, err) in enumerate(results) if code != 0]
    aborted = [i for i, _, err in failed if "terminate called" in err]
    assert not failed, (f"{len(failed)} of {LAUNCHES} launches failed ({len(aborted)} aborted at "
                        f"exit); the first:\n{failed[0][2][-3000:]}")
