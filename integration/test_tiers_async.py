"""The node-local tier of an async ``Checkpointer`` on gloo: 2 ranks on 2 simulated nodes, one
launch shared by every test here (module-scoped). Each rank:

1. ``Checkpointer(async_save=True, local=LocalTier(every=2), durable_every=4)`` trains steps
   1-6, saving each: the node files of each local save are written in the background thread,
   after ``save()`` has returned; the optimizer's next update waits until they are written.
   Hooks on the engine record the order: one before the Checkpointer's own (the update is
   reached, and the write is let go only then) and one after it (the update runs: the write
   must be done by then). The state right after ``save(6)`` is recorded;
2. a fresh engine resumes from the local tier: step 6, bit-exact with that record;
3. with a full node (a 1-byte quota) and the local and durable tiers due at the same step (4):
   the node's write fails in the background, the tier turns off, and the durable save of step 4
   is written from the live shards before the next update (it waits); a fresh engine resumes
   that durable step 4 bit-exact;
4. rank 1's write of a local step 4 fails (an OSError) after step 2 was committed: ``save(4)``
   returns on both ranks, the next update does not hang, ``wait()`` raises the failure on both,
   no node commits step 4, and a fresh engine resumes step 2 bit-exact.
"""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from testing.engines import tiny_engine, tiny_step
from testing.ranks import gloo_threads, run_ranks

pytestmark = pytest.mark.slow

PG_TIMEOUT = 30
HOLD_S = 60  # how long a write waits for the update to be reached: only a broken order waits it out


def _digest(engine) -> dict:
    import torch

    out = {f"{g}.{k}": hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
           for g, kinds in sorted(engine.local_shards().items()) for k, t in sorted(kinds.items())}
    out["rand"] = torch.rand(2).tolist()  # the RNG state, restored from the rank files
    return out


class _Order:
    """What happened in which order around the background writes of the node files."""

    def __init__(self) -> None:
        self.returned = threading.Event()  # save() returned
        self.reached = threading.Event()   # the next update was reached (before any wait)
        self.written = threading.Event()   # the node files of the save in flight are written
        self.pending = False               # a node write began since the last update
        self.log: list[str] = []

    def watch_writes(self) -> None:
        from shardckpt.training import save_load

        write_files, order = save_load.SaveJob.write_files, self

        def held(job, *args, **kwargs):
            if "/local/node" not in job.url:
                return write_files(job, *args, **kwargs)
            order.pending = True
            order.log.append(f"write starts, save() returned: {order.returned.is_set()}")
            order.log.append(f"update reached first: {order.reached.wait(HOLD_S)}")
            try:
                return write_files(job, *args, **kwargs)
            finally:
                order.written.set()

        save_load.SaveJob.write_files = held

    def before(self) -> None:  # registered before the Checkpointer's hook
        self.reached.set()

    def after(self) -> None:  # registered after it: the update runs now
        if self.pending:
            self.log.append(f"update runs, files written: {self.written.is_set()}")
            self.pending = False


def job(rank: int, world: int, root: str) -> dict:
    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.runtime import init_distributed
    from shardckpt.training.checkpointer import Checkpointer

    pm = init_distributed(timeout_s=PG_TIMEOUT)
    order = _Order()
    order.watch_writes()
    engine, opt = tiny_engine(pm)
    engine.register_update_pre_hook(order.before)
    tier = LocalTier(path=f"{root}/local/node{{node}}", every=2, keep=2, peers=1, ranks_per_node=1)
    out: dict = {"gloo_threads": [gloo_threads()]}
    ckpt = Checkpointer(f"{root}/durable", engine, local=tier, durable_every=4, async_save=True)
    engine.register_update_pre_hook(order.after)
    for i in range(1, 7):
        tiny_step(engine, opt, i, pm.rank)
        order.returned.clear()
        order.reached.clear()
        order.written.clear()
        ckpt.save(i)
        order.returned.set()
        if i == 6:
            out["saved"] = _digest(engine)
    tiny_step(engine, opt, 7, pm.rank)  # the update waits for the step-6 files
    ckpt.close()
    out["gloo_threads"].append(gloo_threads())
    out["order"] = order.log
    fresh, _ = tiny_engine(pm)
    again = Checkpointer(f"{root}/durable", fresh, local=tier, async_save=True)
    out["start"], out["resume"] = again.resume(), again.last_resume
    out["resumed"] = _digest(fresh)
    again.close()

    # a full node where both tiers are due: the durable save from the live shards
    full = LocalTier(path=f"{root}/full/node{{node}}", every=4, keep=2, peers=1, ranks_per_node=1,
                     quota_bytes=1)
    engine, opt = tiny_engine(pm)
    ckpt = Checkpointer(f"{root}/full-durable", engine, local=full, durable_every=4, async_save=True)
    for i in range(1, 5):
        tiny_step(engine, opt, i, pm.rank)
        ckpt.save(i)
    out["full_saved"] = _digest(engine)
    tiny_step(engine, opt, 5, pm.rank)  # waits for the durable write of step 4
    ckpt.close()
    out["full_tier_on"] = ckpt.tier.enabled
    fresh, _ = tiny_engine(pm)
    again = Checkpointer(f"{root}/full-durable", fresh, local=full, async_save=True)
    out["full_start"], out["full_resume"] = again.resume(), again.last_resume
    out["full_resumed"] = _digest(fresh)
    again.close()
    out["gloo_threads"].append(gloo_threads())
    out.update(_failing_write(pm, root))
    out["gloo_threads"].append(gloo_threads())
    return out


def _failing_write(pm, root: str) -> dict:
    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.training import save_load
    from shardckpt.training.checkpointer import Checkpointer

    write_files = save_load.SaveJob.write_files

    def fails(job, *args, **kwargs):
        if pm.rank == 1 and "/failing/node" in job.url and job.url.endswith("step-00000004"):
            raise OSError(5, "injected: input/output error")
        return write_files(job, *args, **kwargs)

    save_load.SaveJob.write_files = fails
    tier = LocalTier(path=f"{root}/failing/node{{node}}", every=2, keep=3, peers=1, ranks_per_node=1)
    engine, opt = tiny_engine(pm)
    ckpt = Checkpointer(f"{root}/failing-durable", engine, local=tier, durable_every=100, async_save=True)
    out: dict = {}
    for i in range(1, 5):
        tiny_step(engine, opt, i, pm.rank)
        ckpt.save(i)
        if i == 2:
            ckpt.wait()
            out["failing_saved"] = _digest(engine)
    tiny_step(engine, opt, 5, pm.rank)  # the failed write let the update go
    try:
        ckpt.wait()
        out["failing_error"] = None
    except Exception as e:  # noqa: BLE001 - what the test looks at
        out["failing_error"] = f"{type(e).__name__}: {e}"
    ckpt.close()
    save_load.SaveJob.write_files = write_files
    fresh, _ = tiny_engine(pm)
    again = Checkpointer(f"{root}/failing-durable", fresh, local=tier, async_save=True)
    out["failing_start"], out["failing_resume"] = again.resume(), again.last_resume
    out["failing_resumed"] = _digest(fresh)
    again.close()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tiers-async"))
    return {"root": root, "ranks": run_ranks(job, 2, args=(root,), timeout_s=240,
                                             pg_timeout_s=PG_TIMEOUT)}


def test_async_local_save_returns_before_the_node_write_and_the_update_waits_for_it(run):
    for r in run["ranks"]:
        assert r.ok, r.describe()
        log = r.value["order"]
        # local saves at 2, 4 (durable too: copied from the node) and 6
        assert log == ["write starts, save() returned: True", "update reached first: True",
                       "update runs, files written: True"] * 3, log


def test_close_destroys_the_checkpointers_group(run):
    # after each close() (of a run that saved, one whose node was full, one whose write
    # failed), the Checkpointer's own gloo group is destroyed: its threads are joined there,
    # not left to the interpreter's exit, where a gloo thread can abort the process
    for r in run["ranks"]:
        counts = r.value["gloo_threads"]
        assert len(counts) == 4 and len(set(counts)) == 1 and counts[0] > 0, counts


def test_async_local_save_resumes_bit_exact(run):
    for r in run["ranks"]:
        v = r.value
        assert v["start"] == 6 and v["resume"]["tier"] == "local", v["resume"]
        assert v["resumed"] == v["saved"]


def test_full_node_in_an_async_save_writes_the_durable_step_from_memory(run):
    from shardckpt.checkpoint.run_dir import CheckpointManager

    for r in run["ranks"]:
        v = r.value
        assert v["full_tier_on"] is False
        assert v["full_start"] == 4 and v["full_resume"]["tier"] == "durable", v["full_resume"]
        assert v["full_resumed"] == v["full_saved"]
    mgr = CheckpointManager(os.path.join(run["root"], "full-durable"))
    assert [f.step for f in mgr.committed()] == [4]
    assert mgr.check(mgr.committed()[0], full=True) == []
    assert not os.path.exists(os.path.join(run["root"], "full", "node0", "step-00000004", "manifest.json"))


def test_failed_background_write_surfaces_at_wait_and_keeps_the_previous_step(run):
    for r in run["ranks"]:
        v = r.value
        assert v["failing_error"] is not None and "local save" in v["failing_error"], v["failing_error"]
        assert "injected" in v["failing_error"], v["failing_error"]
        assert v["failing_start"] == 2 and v["failing_resume"]["tier"] == "local", v["failing_resume"]
        assert v["failing_resumed"] == v["failing_saved"]
    for node in ("node0", "node1"):
        here = os.path.join(run["root"], "failing", node)
        assert os.path.exists(os.path.join(here, "step-00000002", "manifest.json"))
        assert not os.path.exists(os.path.join(here, "step-00000004", "manifest.json"))
