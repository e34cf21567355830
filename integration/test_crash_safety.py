"""A rank killed (SIGKILL) during a save: survivors fail in bounded time, nothing commits,
``latest`` keeps naming the previous checkpoint, which verifies and loads.

The victim dies after a set number of bytes of its shard are written (a counting fsspec
filesystem kills it), not after a sleep.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

try:
    from .distutil import run_distributed, run_ranks
    from .fsspec_probes import register
    from .test_save_load import build, batches, train
except ImportError:
    from distutil import run_distributed, run_ranks
    from fsspec_probes import register
    from test_save_load import build, batches, train

pytestmark = pytest.mark.slow
PG_TIMEOUT = 20


def job_save_then_die(rank: int, world: int, root: str, victim: int, kill_after: int) -> dict:
    from shardckpt.errors import CollectiveError
    from shardckpt.manager import CheckpointManager
    from shardckpt.runtime import init_distributed
    from shardckpt.save_load import save

    register()
    pm = init_distributed(timeout_s=PG_TIMEOUT)
    cfg, engine, opt = build(pm, seed=0)
    data = batches(cfg, pm.rank, world)
    mgr = CheckpointManager(root)
    train(engine, opt, data, range(1))
    save(engine, mgr.url_for(1), extras={"step": 1})
    if rank == 0:
        mgr.mark_committed(1)
    train(engine, opt, data, range(1, 2))
    if rank == victim:
        os.environ["SHARDCKPT_TEST_KILL_AFTER"] = str(kill_after)
    t0 = time.monotonic()
    try:
        save(engine, "killfile://" + mgr.url_for(2), extras={"step": 2})
    except CollectiveError as e:
        return {"outcome": "CollectiveError", "seconds": time.monotonic() - t0, "message": str(e)}
    return {"outcome": "saved", "seconds": time.monotonic() - t0}


def job_load(rank: int, world: int, url: str) -> dict:
    from shardckpt.runtime import init_distributed
    from shardckpt.save_load import load

    pm = init_distributed(timeout_s=60)
    _, engine, opt = build(pm, seed=7)
    load(engine, url)
    return {"steps": [g["step"] for g in opt.optimizer_metadata()["param_groups"]]}


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-dies", "rank1-dies"])
def test_rank_killed_mid_save(tmp_path, victim):
    from shardckpt.checkpoint import verify
    from shardckpt.manager import CheckpointManager, step_dir
    from shardckpt.manifest import MANIFEST_NAME

    root = str(tmp_path)
    results = run_ranks(job_save_then_die, 3, args=(root, victim, 20_000), timeout_s=150,
                        pg_timeout_s=PG_TIMEOUT)
    dead = results[victim]
    assert not dead.ok and dead.exitcode == -signal.SIGKILL, dead.describe()
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, r.describe()
        assert r.value["outcome"] == "CollectiveError", r.value
        assert r.value["seconds"] < PG_TIMEOUT + 15, r.value
        assert "save to" in r.value["message"] or "commit of" in r.value["message"]
    # the victim had started writing its shard: debris exists, but no manifest
    step2 = os.path.join(root, step_dir(2))
    assert any(f.startswith("shard-") for _, _, fs in os.walk(step2) for f in fs)
    assert not os.path.exists(os.path.join(step2, MANIFEST_NAME))
    mgr = CheckpointManager(root)
    assert mgr.read_latest() == step_dir(1)
    assert mgr.resume_point(full_verify=True).step == 1
    _, reports, problems = verify(mgr.url_for(1))
    assert not problems and all(r.ok for r in reports)
    out = run_distributed(job_load, 2, args=(mgr.url_for(1),), timeout_s=120)
    assert all(o["steps"] == [1, 1] for o in out)
