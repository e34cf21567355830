"""A rank killed (SIGKILL) during a save: survivors fail instead of hanging, nothing commits,
``latest`` keeps naming the previous checkpoint, which verifies and loads. A rank killed after
the manifest was created: survivors say the checkpoint committed, and ``latest`` agrees with
what resume picks.

The victim dies after a set number of bytes of its shard are written (a counting fsspec
filesystem kills it), or right after the manifest exists, not after a sleep.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from testing.engines import llama_batches, llama_engine, train_llama
from testing.fsspec_probes import register
from testing.ranks import run_distributed, run_ranks

pytestmark = pytest.mark.slow
PG_TIMEOUT = 20


def job_save_then_die(rank: int, world: int, root: str, victim: int, kill_after: int) -> dict:
    from shardckpt.errors import CollectiveError
    from shardckpt.checkpoint.run_dir import CheckpointManager
    from shardckpt.runtime import init_distributed
    from shardckpt.training.save_load import save

    register()
    pm = init_distributed(timeout_s=PG_TIMEOUT)
    cfg, engine, opt = llama_engine(pm, seed=0)
    data = llama_batches(cfg, pm.rank, world)
    mgr = CheckpointManager(root)
    train_llama(engine, opt, data, range(1))
    save(engine, mgr.url_for(1), extras={"step": 1})
    if rank == 0:
        mgr.mark_committed(1)
    train_llama(engine, opt, data, range(1, 2))
    if rank == victim:
        os.environ["SHARDCKPT_TEST_KILL_AFTER"] = str(kill_after)
    try:
        save(engine, "killfile://" + mgr.url_for(2), extras={"step": 2})
    except CollectiveError as e:
        return {"outcome": "CollectiveError", "message": str(e)}
    return {"outcome": "saved"}


def job_load(rank: int, world: int, url: str) -> dict:
    from shardckpt.runtime import init_distributed
    from shardckpt.training.save_load import load

    pm = init_distributed(timeout_s=60)
    _, engine, opt = llama_engine(pm, seed=7)
    load(engine, url)
    return {"steps": [g["step"] for g in opt.optimizer_metadata()["param_groups"]]}


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-dies", "rank1-dies"])
def test_rank_killed_mid_save(tmp_path, victim):
    from shardckpt.checkpoint.verify import verify
    from shardckpt.checkpoint.run_dir import CheckpointManager, step_dir
    from shardckpt.format.manifest import MANIFEST_NAME

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
        message = r.value["message"]
        assert "save to" in message or "commit of" in message, message
        assert "lost contact" in message and "nothing was committed" in message, message
        assert "timed out" not in message.lower(), message  # seen at once, not at the timeout
    # the victim had started writing its shard: debris exists, but no manifest
    step2 = os.path.join(root, step_dir(2))
    assert any(f.startswith("shard-") for _, _, fs in os.walk(step2) for f in fs)
    assert not os.path.exists(os.path.join(step2, MANIFEST_NAME))
    mgr = CheckpointManager(root)
    assert mgr.read_latest() == step_dir(1)
    assert mgr.resume_point(full_verify=True).step == 1
    result = verify(mgr.url_for(1))
    assert result, result.problems
    out = run_distributed(job_load, 2, args=(mgr.url_for(1),), timeout_s=120)
    assert all(o["steps"] == [1, 1] for o in out)


def job_die_after_manifest(rank: int, world: int, root: str, victim: int) -> dict:
    from shardckpt.checkpoint import collective
    from shardckpt.checkpoint.writer import CheckpointWriter
    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.errors import CollectiveError
    from shardckpt.checkpoint.run_dir import step_dir
    from shardckpt.format.manifest import MANIFEST_NAME
    from shardckpt.runtime import init_distributed

    pm = init_distributed(timeout_s=PG_TIMEOUT)
    cfg, engine, opt = llama_engine(pm, seed=0)
    data = llama_batches(cfg, pm.rank, world)
    ckpt = Checkpointer(root, engine, keep_last=None)
    train_llama(engine, opt, data, range(1))
    ckpt.save(1)
    train_llama(engine, opt, data, range(1, 2))
    manifest = os.path.join(root, step_dir(2), MANIFEST_NAME)
    if rank == victim == 0:  # rank 0 creates the manifest, then dies before the last exchange
        commit = CheckpointWriter.commit

        def commit_then_die(self, entries):
            commit(self, entries)
            os.kill(os.getpid(), signal.SIGKILL)

        CheckpointWriter.commit = commit_then_die
    elif rank == victim:  # another rank dies once the manifest exists, before the last exchange
        agree = collective.agree  # the save's attempt agrees through it

        def die_once_committed(fn, what, group=None, after_loss=None, flag=None):
            if what.startswith("commit of"):
                while not os.path.exists(manifest):  # the parent's join timeout bounds this
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            return agree(fn, what, group, after_loss, flag)

        collective.agree = die_once_committed
    try:
        ckpt.save(2)
    except CollectiveError as e:
        return {"outcome": "CollectiveError", "message": str(e)}
    return {"outcome": "saved"}


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-dies", "rank1-dies"])
def test_rank_killed_after_the_manifest_was_created(tmp_path, victim):
    from shardckpt.checkpoint.run_dir import CheckpointManager, step_dir
    from shardckpt.format.manifest import MANIFEST_NAME

    root = str(tmp_path)
    results = run_ranks(job_die_after_manifest, 3, args=(root, victim), timeout_s=150,
                        pg_timeout_s=PG_TIMEOUT)
    assert results[victim].exitcode == -signal.SIGKILL, results[victim].describe()
    manifest = os.path.join(root, step_dir(2), MANIFEST_NAME)
    assert os.path.exists(manifest)
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok and r.value["outcome"] == "CollectiveError", r.describe()
        message = r.value["message"]
        assert "commit of" in message and "nothing was committed" not in message, message
        assert f"committed anyway: {manifest} exists, and resume picks it" in message, message
    mgr = CheckpointManager(root)
    assert mgr.resume_point(full_verify=True).step == 2
    # rank 0, if it survived, pointed latest at what resume picks; if it died, the message says
    # that resume picks the new checkpoint whatever latest says
    assert mgr.read_latest() == step_dir(2 if victim else 1)
