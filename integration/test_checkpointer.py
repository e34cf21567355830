"""The training-loop API: async save, application state, resume on another world size.

One launch of 2 ranks runs every scenario in turn (module-scoped ``run``), each in a directory of
its own: an async save (slowed writes, an injected write error); application state saved after
3 steps, then resumed on the same 2 ranks; two saves, rank 1's newest shard damaged, and a resume
that falls back past it; last, rank 0 alone in a new group of 1 resumes the application state
resharded for one rank. Each test asserts on its part.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from testing.ckpt_runs import coordinator, flip_bit, new_world
from testing.engines import llama_batches, llama_engine, train_llama
from testing.fsspec_probes import SlowFS, register_all
from testing.ranks import gloo_threads, run_distributed

pytestmark = pytest.mark.slow


def _async(pm, root: str) -> dict:
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.checkpoint.run_dir import CheckpointManager, step_dir

    register_all()
    cfg, engine, opt = llama_engine(pm, seed=0)
    data = llama_batches(cfg, pm.rank, pm.world_size)
    out: dict = {}
    # 1. snapshot isolation and overlap: writes are slowed down, training goes on meanwhile
    os.environ["SHARDCKPT_TEST_WRITE_DELAY"] = "0.05"
    threads_before = gloo_threads()
    ckpt = Checkpointer(f"slowfile://{root}/run", engine, async_save=True)
    train_llama(engine, opt, data, range(1))
    snapshot = {g: {k: t.clone() for k, t in kinds.items()} for g, kinds in engine.local_shards().items()}
    t0 = time.monotonic()
    ckpt.save(1)
    out["blocking_s"] = time.monotonic() - t0
    train_llama(engine, opt, data, range(1, 2))  # changes the live masters and moments
    out["step_done"] = time.monotonic()
    out["in_flight_after_step"] = ckpt.in_flight
    ckpt.wait()
    out["write_done"] = SlowFS.last_write_end
    os.environ["SHARDCKPT_TEST_WRITE_DELAY"] = "0"
    reader = CheckpointReader(f"{root}/run/{step_dir(1)}")
    shard = pm.shard_rank
    bad = []
    for g, kinds in snapshot.items():
        for k, t in kinds.items():
            saved = bytes(reader.read_state(shard, g, k))
            if saved != t.numpy().tobytes():
                bad.append(f"{g}.{k}")
            if saved == engine.local_shards()[g][k].numpy().tobytes():
                bad.append(f"{g}.{k} equals the state after the next step")
    out["snapshot_problems"] = bad
    # 2. an injected write error surfaces at the next call; the previous checkpoint stays good
    fail = Checkpointer(f"failfile://{root}/run", engine, async_save=True)
    os.environ["SHARDCKPT_TEST_FAIL_WRITES"] = "1"
    fail.save(2)
    try:
        fail.wait()
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - what the test inspects
        out["error"] = f"{type(e).__name__}: {e}"
    os.environ.pop("SHARDCKPT_TEST_FAIL_WRITES")
    mgr = CheckpointManager(f"{root}/run")
    out["latest"] = mgr.read_latest()
    out["resume_step"] = mgr.resume_point(full_verify=True).step
    threads_open = gloo_threads()
    fail.close()
    ckpt.close()
    # close() destroyed each Checkpointer's own gloo group: its threads are joined now, not
    # left to the interpreter's exit (where a gloo thread can abort the process)
    out["gloo_threads"] = [threads_before, threads_open, gloo_threads()]
    return out


# --------------------------------------------------------------------- application state


def _app_state(pm, run: str, steps: int, micro_batch: int) -> dict:
    from torch.optim.lr_scheduler import LambdaLR

    from shardckpt.training.checkpointer import Checkpointer, JsonState
    from shardckpt.runtime.data import SyntheticCorpus, TokenBatches

    cfg, engine, opt = llama_engine(pm, seed=0)
    sched = LambdaLR(opt, lambda s: 0.5 ** s)
    data = TokenBatches(SyntheticCorpus(cfg.vocab_size, seed=1), seq_len=16, micro_batch=micro_batch,
                        rank=pm.rank, world_size=pm.world_size)
    user = JsonState({"note": "hello", "evals": []})
    ckpt = Checkpointer(run, engine, app_state={"scheduler": sched, "data": data, "user": user}, seed=11)
    start = ckpt.resume()
    out = {"start": start, "lr_at_start": sched.get_last_lr(), "samples_at_start": data.state_dict(),
           "user_at_start": user.state_dict(), "rand_after_resume": torch.rand(3).tolist()}
    from shardckpt.runtime.models.llama import causal_lm_loss

    for step in range(start, start + steps):
        tokens = next(data)
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        user.data["evals"].append(step)
    ckpt.save(start + steps)
    out["lr_at_end"] = sched.get_last_lr()
    out["rand_after_save"] = torch.rand(3).tolist()
    ckpt.close()
    return out


# ------------------------------------------------------------------ resume past a damaged one


def _save_steps(pm, run: str, steps: list) -> None:
    from shardckpt.training.checkpointer import Checkpointer

    cfg, engine, opt = llama_engine(pm, seed=0)
    data = llama_batches(cfg, pm.rank, pm.world_size)
    ckpt = Checkpointer(run, engine, keep_last=None)
    for step in steps:
        train_llama(engine, opt, data, range(step - 1, step))
        ckpt.save(step)
    ckpt.close()


def _flip_a_bit(run: str) -> int:
    """Flip one bit of rank 1's shard of step 2 (the size still checks out); the step a resume
    without the checksums would take."""
    from shardckpt.checkpoint.run_dir import CheckpointManager

    mgr = CheckpointManager(run)
    flip_bit(mgr.url_for(2), "shard-00001-")
    return mgr.resume_point().step


def _resume(pm, run: str) -> dict:
    import logging

    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.training.checkpointer import Checkpointer

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("shardckpt")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _, engine, opt = llama_engine(pm, seed=5)
        step = Checkpointer(run, engine).resume()
    finally:
        logger.removeHandler(handler)
    reader = CheckpointReader(f"{run}/step-{step:08d}")
    differ = [f"{g}.{k}" for g, kinds in engine.local_shards().items() for k, t in kinds.items()
              if bytes(reader.read_state(pm.shard_rank, g, k)) != t.numpy().tobytes()]
    return {"step": step, "differ": differ,
            "opt_steps": [g["step"] for g in opt.optimizer_metadata()["param_groups"]],
            "logs": [(r.levelname, r.getMessage()) for r in records
                     if r.name in ("shardckpt.checkpoint.resume_policy", "shardckpt.checkpoint.set_aside")]}


# ------------------------------------------------------------------------------ the launch


def job(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from shardckpt.checkpoint.run_dir import step_dir
    from shardckpt.runtime import init_distributed
    from shardckpt.tools.reshard import reshard

    store = coordinator()
    pm = init_distributed(timeout_s=60)
    out: dict = {"async": _async(pm, f"{root}/async")}
    run2, run1 = f"{root}/app/run2", f"{root}/app/run1"
    out["first"] = _app_state(pm, run2, 3, 2)
    out["same"] = _app_state(pm, run2, 1, 2)
    damaged = f"{root}/damaged/run"
    _save_steps(pm, damaged, [1, 2])
    dist.barrier()
    if rank == 0:
        out["resume_point_after_flip"] = _flip_a_bit(damaged)
    dist.barrier()
    out["resume"] = _resume(pm, damaged)
    # another world size: app state carries over; RNG re-seeded from seed + rank
    if new_world(store, "world1", 1, rank):
        reshard(f"{run2}/{step_dir(3)}", f"{run1}/{step_dir(3)}", to=1)
        out["other"] = _app_state(init_distributed(timeout_s=60), run1, 1, 4)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpointer"))
    return {"root": root,
            "out": run_distributed(job, 2, args=(root,), timeout_s=400, pg_timeout_s=60)}


def test_async_save(run):
    from shardckpt.checkpoint.run_dir import step_dir

    for o in (r["async"] for r in run["out"]):
        assert o["snapshot_problems"] == [], o["snapshot_problems"]
        assert o["in_flight_after_step"], "the write finished before the next step did"
        assert o["step_done"] < o["write_done"]
        assert o["error"] and "ENOSPC" in o["error"] or "No space left" in (o["error"] or ""), o["error"]
        assert o["latest"] == step_dir(1) and o["resume_step"] == 1
        before, open_, after = o["gloo_threads"]
        assert open_ == before + 4 and after == before, o["gloo_threads"]  # two groups, 2 threads each
    assert not os.path.exists(os.path.join(run["root"], "async", "run", step_dir(2), "manifest.json"))


def test_app_state_round_trip_and_resume_on_other_world_size(run):
    first = [r["first"] for r in run["out"]]
    same = [r["same"] for r in run["out"]]
    assert first[0]["start"] == 0
    # same world size: everything, RNG included, continues where it stopped
    for a, b in zip(first, same, strict=True):
        assert b["start"] == 3
        assert b["lr_at_start"] == a["lr_at_end"] == [3e-3 * 0.5 ** 3] * 2
        assert b["samples_at_start"]["samples_seen"] == 3 * 4
        assert b["user_at_start"] == {"note": "hello", "evals": [0, 1, 2]}
        assert b["rand_after_resume"] == a["rand_after_save"]
    # another world size: app state carries over; RNG re-seeded from seed + rank
    other = run["out"][0]["other"]
    assert "other" not in run["out"][1]
    assert other["start"] == 3 and other["lr_at_start"] == first[0]["lr_at_end"]
    assert other["samples_at_start"]["samples_seen"] == 12
    torch.manual_seed(11 + 0)
    assert other["rand_after_resume"] == torch.rand(3).tolist()


def test_resume_falls_back_past_a_damaged_newest_checkpoint(run):
    from shardckpt.checkpoint.run_dir import CheckpointManager, step_dir

    mgr = CheckpointManager(f"{run['root']}/damaged/run")
    assert run["out"][0]["resume_point_after_flip"] == 2
    out = [r["resume"] for r in run["out"]]
    for o in out:
        assert o["step"] == 1 and o["differ"] == [] and o["opt_steps"] == [1, 1], o
    infos = [m for level, m in out[0]["logs"] if level == "INFO"]
    warnings = [m for level, m in out[0]["logs"] if level == "WARNING"]
    assert infos == [f"resumed from {mgr.url_for(1)} (step 1)"], out[0]["logs"]
    assert len(warnings) == 2 and mgr.url_for(2) in warnings[0] and "rank(s) [1]" in warnings[0]
    # the passed-over step is put aside (renamed, nothing deleted), saying why, so that the run
    # can save step 2 again; latest names the step resumed
    assert "was passed over at resume" in warnings[1] and "fails its checksums" in warnings[1]
    assert out[1]["logs"] == []  # said once, by rank 0
    assert [f.step for f in mgr.committed()] == [1]
    [aside] = os.listdir(os.path.join(run["root"], "damaged", "run", "passed-over"))
    assert aside.startswith(step_dir(2) + ".") and aside in warnings[1]
    assert mgr.read_latest() == step_dir(1)
