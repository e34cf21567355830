"""The node-local tier with peer copies on gloo: 2 ranks on 2 simulated nodes (``{node}`` paths;
the node logic with several ranks a node is covered by ``tests/test_tiers.py`` and the benchmark).

One run, seven launches, shared by every test here (module-scoped):

1. ``first``: train steps 1-8 saving (local every 2, durable every 4) up to step 6, record the
   state after step 8 (fp32 masters, Adam moments, optimizer steps, the next random numbers),
   then rank 1 is SIGKILLed in the middle of step 9;
2. ``restart``: resume (the local tier, each node's own copies), train to 8, compare; then rank 1
   is SIGKILLed while writing its shard file of the step-8 save;
3. node 1's directory is deleted; ``peers``: resume (step 6 from node 0's peer copies, not the
   half step 8; through the read pipeline, ``SHARDCKPT_IO_PIPELINE=1``, as into device shards),
   train to 8, compare; then the local tier is full (a 1-byte quota): one warning,
   durable saves at 8 and 12 from memory;
4. ``world1``: one rank resumes from the local tier alone (the run's durable checkpoints set
   aside meanwhile, so the local step 6 is the newest of the run; node 0 holds
   rank 1's shard as its peer) and loads what a plain load of node 0's step 6 gives; then, with
   one bit of that copy flipped, resume refuses it (checksums) and takes the previous local step;
5. ``copy_kill`` (4 ranks on 2 nodes, a directory of its own): rank 3 is SIGKILLed in the middle
   of sending its step-4 files to its peer; every survivor fails that save with "lost contact"
   (the group's timeout is longer than the launch's, so waiting for it would fail the test), and
   no node commits step 4; ``copy_kill_restart`` resumes step 2 and trains to 4, bit-exact;
6. ``frozen`` (2 ranks on 2 nodes, a directory of its own): a frozen base and a small adapter,
   local every step, durable every 2 up to 6: the durable copies of 4 and 6 reference step 2's
   frozen files instead of copying them, through watched agreements; the ranks then resume from
   the durable step 6 alone, bit-exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal

import pytest

from testing.ckpt_runs import flip_bit, record
from testing.engines import tiny_engine, tiny_step
from testing.ranks import run_ranks

pytestmark = pytest.mark.slow

PG_TIMEOUT = 30
LONG_PG_TIMEOUT = 600
REF_STEP = 8


def _digest(engine, opt) -> dict:
    import torch

    out = {f"{g}.{k}": hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
           for g, kinds in sorted(engine.local_shards().items()) for k, t in sorted(kinds.items())}
    out["opt_steps"] = [g["step"] for g in opt.optimizer_metadata()["param_groups"]]
    out["rand"] = torch.rand(2).tolist()  # the RNG state, restored from the rank files
    return out


def _capture():
    import logging

    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("shardckpt")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return records


def _count_pipelined() -> dict:
    """Counts of the peer streams into memory and the local files read through the read pipeline
    (``SHARDCKPT_IO_PIPELINE=1``: the CPU shards take the path device shards take)."""
    from shardckpt.training import direct_pipe, peer_copy

    counts = {"streams": 0, "local": 0}

    def counted(fn, key):
        def run(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return run
    peer_copy.stream_into = counted(peer_copy.stream_into, "streams")
    direct_pipe.pipelined_reads = counted(direct_pipe.pipelined_reads, "local")
    return counts


def job(rank: int, world: int, root: str, phase: str) -> dict:
    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.runtime import init_distributed
    from shardckpt.training.checkpointer import Checkpointer

    records = _capture()
    piped = _count_pipelined() if phase == "peers" else {}
    pm = init_distributed(timeout_s=PG_TIMEOUT)
    engine, opt = tiny_engine(pm)
    tier = LocalTier(path=f"{root}/local/node{{node}}", every=2, keep=2, peers=1,
                     ranks_per_node=1, quota_bytes=1 if phase == "peers" else None)
    durable = f"{root}/durable"
    ckpt = Checkpointer(durable, engine, local=tier, durable_every=4, keep_last=3)
    start = ckpt.resume()
    out: dict = {"start": start, "resume": ckpt.last_resume, "piped": dict(piped)}
    if phase == "world1":
        from shardckpt.training.save_load import load

        mine = _digest(engine, opt)
        engine2, opt2 = tiny_engine(pm)
        load(engine2, f"{root}/local/node0/step-{start:08d}")
        plain = _digest(engine2, opt2)
        out["same_as_plain_load"] = {k: v for k, v in mine.items() if k != "rand"} == \
            {k: v for k, v in plain.items() if k != "rand"}
        # one flipped bit in node 0's copy of rank 1's shard: the size still checks out, the
        # checksums do not; the previous local step (4) is taken instead
        flip_bit(f"{root}/local/node0/step-{start:08d}", "shard-00001-")
        again = Checkpointer(durable, engine, local=tier)
        out["damaged"] = {"step": again.resume(), "resume": again.last_resume,
                          "warnings": [r.getMessage() for r in records if r.levelname == "WARNING"
                                       and "fails its checksums" in r.getMessage()]}
        return out
    for i in range(start + 1, REF_STEP + 1):
        tiny_step(engine, opt, i, pm.rank)
        if phase == "first" and i <= 6:
            ckpt.save(i)
    ckpt.wait()
    record(root, phase, rank, _digest(engine, opt))
    if phase in ("first", "restart"):
        if phase == "first" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if phase == "restart" and rank == 1:  # dies in the middle of writing its shard file
            from shardckpt.storage.writer import LocalSink

            write = LocalSink.write

            def write_then_die(self, view):
                write(self, view)
                if "step-00000008" in self.path:  # the header is on disk, the tensors not yet
                    self.f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            LocalSink.write = write_then_die
        try:
            if phase == "first":
                tiny_step(engine, opt, REF_STEP + 1, pm.rank)
            else:
                ckpt.save(REF_STEP)
                ckpt.wait()
            out["outcome"] = "went on"
        except Exception as e:  # noqa: BLE001 - what the test inspects
            out["outcome"] = f"{type(e).__name__}: {e}"
        # leave at once: a survivor that waited for the others would keep a rank that is still
        # in a collective with it from seeing the loss until the group's timeout
        record(root, f"{phase}-outcome", rank, out)
        os._exit(0)
    # peers: the tier is full from here on (quota 1 byte): durable-only saves
    ckpt.save(REF_STEP)
    for i in range(REF_STEP + 1, 13):
        tiny_step(engine, opt, i, pm.rank)
        ckpt.save(i)
    ckpt.close()
    out["warnings"] = [r.getMessage() for r in records if r.levelname == "WARNING"]
    out["tier_on"] = ckpt.tier.enabled
    return out


def _send_once_then_die(send, dst: int):
    """``send`` that kills this process at its second message to ``dst``."""
    sent: list = []

    def send_then_die(tensor, to, *args, **kwargs):
        if to == dst:
            if sent:
                os.kill(os.getpid(), signal.SIGKILL)
            sent.append(tensor.numel())
        return send(tensor, to, *args, **kwargs)
    return send_then_die


def job_copy_kill(rank: int, world: int, root: str, phase: str) -> dict:
    """4 ranks on 2 nodes: ``kill``: local saves at 2 and 4; rank 3 is SIGKILLed in the middle of
    sending its step-4 files to its peer (rank 1), after the other copies; the survivors report
    what ``wait`` raised. ``restart``: resume, train to 4, record the state."""
    import torch.distributed as dist

    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.runtime import init_distributed
    from shardckpt.training.checkpointer import Checkpointer

    pm = init_distributed(timeout_s=LONG_PG_TIMEOUT if phase == "kill" else PG_TIMEOUT)
    engine, opt = tiny_engine(pm)
    tier = LocalTier(path=f"{root}/local/node{{node}}", every=2, keep=2, peers=1, ranks_per_node=2)
    ckpt = Checkpointer(f"{root}/durable", engine, local=tier, durable_every=1000)
    start = ckpt.resume()
    out: dict = {"start": start, "resume": ckpt.last_resume}
    for i in range(start + 1, 5):
        tiny_step(engine, opt, i, pm.rank)
        if phase == "kill" and i == 4:
            ckpt.wait()
            record(root, "state", rank, _digest(engine, opt))
            if rank == 3:  # the offer is taken, then the first piece of the file never comes
                dist.send = _send_once_then_die(dist.send, 1)
        if phase == "kill":
            ckpt.save(i)
    try:
        ckpt.wait()
        out["outcome"] = "saved"
    except Exception as e:  # noqa: BLE001 - what the test inspects
        out["outcome"] = f"{type(e).__name__}: {e}"
    if phase == "restart":
        out["state"] = _digest(engine, opt)
        ckpt.close()
    return out


class Tuned:
    """A frozen base (two 64x64 layers) and a small trainable adapter (built lazily: torch is
    imported in the ranks only)."""

    @staticmethod
    def build(pm):
        import torch
        from torch import nn

        from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4, bias=False))
        model[0].requires_grad_(False)
        model[1].requires_grad_(False)
        engine = ZeroEngine(model, process_mesh=pm, deterministic=True)
        return engine, ShardedAdamW(engine, decay_param_groups(engine, 0.0), lr=1e-2)

    @staticmethod
    def step(engine, opt, i: int, rank: int) -> None:
        import torch

        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(100 * i + rank))
        engine(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def job_frozen(rank: int, world: int, root: str) -> dict:
    """Local tier every step (keep 3), durable every 2 (keep 2) up to step 6; record the state after 6 and
    every agreement the tier made (watched or not); then resume from the durable tier alone."""
    import shardckpt.checkpoint.collective as collective_mod
    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.runtime import init_distributed
    from shardckpt.training.checkpointer import Checkpointer

    seen: list = []
    watched = collective_mod.agree

    def record(fn, what, group=None, after_loss=None, flag=None):
        seen.append([what, flag is not None])
        return watched(fn, what, group, after_loss, flag)
    collective_mod.agree = record  # the durable copy's attempt agrees through it
    pm = init_distributed(timeout_s=PG_TIMEOUT)
    engine, opt = Tuned.build(pm)
    tier = LocalTier(path=f"{root}/local/node{{node}}", every=1, keep=3, peers=1, ranks_per_node=1)
    ckpt = Checkpointer(f"{root}/durable", engine, local=tier, durable_every=2, keep_last=2)
    for i in range(1, 7):
        Tuned.step(engine, opt, i, pm.rank)
        ckpt.save(i)
    ckpt.close()
    out: dict = {"state": _digest(engine, opt), "agreements": seen}
    engine2, opt2 = Tuned.build(pm)
    again = Checkpointer(f"{root}/durable", engine2)
    out["start"] = again.resume()
    out["resume"] = again.last_resume
    out["resumed"] = _digest(engine2, opt2)
    again.close()
    return out


def _launch(root: str, phase: str, world: int = 2, env: dict | None = None):
    return run_ranks(job, world, args=(root, phase), timeout_s=120, pg_timeout_s=PG_TIMEOUT,
                     env=env)


def _records(root: str, phase: str, ranks=range(2)) -> list[dict]:
    out = []
    for r in ranks:
        with open(os.path.join(root, f"{phase}-{r}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from shardckpt.checkpoint.run_dir import CheckpointManager

    root = str(tmp_path_factory.mktemp("tiers"))
    out: dict = {"root": root}
    out["first"] = _launch(root, "first")
    out["restart"] = _launch(root, "restart")
    out["step8_after_kill"] = {n: sorted(os.listdir(os.path.join(root, "local", n, "step-00000008")))
                               for n in ("node0", "node1")
                               if os.path.isdir(os.path.join(root, "local", n, "step-00000008"))}
    out["durable_after_restart"] = [f.step for f in CheckpointManager(f"{root}/durable").committed()]
    shutil.rmtree(os.path.join(root, "local", "node1"))  # node 1 lost its memory
    # the resume from peers through the read pipeline, as into device shards: two small buffers
    out["peers"] = _launch(root, "peers", env={"SHARDCKPT_IO_PIPELINE": "1", "SHARDCKPT_IO_BUFFERS": "2",
                                               "SHARDCKPT_IO_BUFFER_SIZE": "8K"})
    durable = os.path.join(root, "durable")
    os.rename(durable, f"{durable}-aside")  # the run's own local steps are all world1 finds
    out["world1"] = _launch(root, "world1", world=1)
    shutil.rmtree(durable, ignore_errors=True)
    os.rename(f"{durable}-aside", durable)
    kill = os.path.join(root, "copy-kill")
    # the group's timeout is past the join's: a survivor that waited for it would be killed as hung
    out["copy_kill"] = run_ranks(job_copy_kill, 4, args=(kill, "kill"), timeout_s=120,
                                 pg_timeout_s=LONG_PG_TIMEOUT)
    out["copy_kill_step4"] = {n: sorted(os.listdir(os.path.join(kill, "local", n, "step-00000004")))
                              for n in sorted(os.listdir(os.path.join(kill, "local")))
                              if os.path.isdir(os.path.join(kill, "local", n, "step-00000004"))}
    out["copy_kill_restart"] = run_ranks(job_copy_kill, 4, args=(kill, "restart"), timeout_s=120,
                                         pg_timeout_s=PG_TIMEOUT)
    out["frozen"] = run_ranks(job_frozen, 2, args=(os.path.join(root, "frozen"),), timeout_s=120,
                              pg_timeout_s=PG_TIMEOUT)
    return out


def test_killed_rank_resumes_from_own_local_copies_bit_exact(run):
    first = run["first"]
    assert first[1].exitcode == -signal.SIGKILL, first[1].describe()
    for o in _records(run["root"], "first-outcome", [0]):
        assert o["outcome"] != "went on", o  # the survivor lost contact with rank 1
    for o in _records(run["root"], "restart-outcome", [0]):
        assert o["start"] == 6
        assert o["resume"]["tier"] == "local" and o["resume"]["fetched"] == 0
    assert _records(run["root"], "restart") == _records(run["root"], "first")


def test_kill_during_local_save_leaves_no_half_checkpoint(run):
    restart = run["restart"]
    assert restart[1].exitcode == -signal.SIGKILL, restart[1].describe()
    for o in _records(run["root"], "restart-outcome", [0]):
        assert "CollectiveError" in o["outcome"] and "local save" in o["outcome"], o
    # the step-8 files were being written on both nodes (rank 1's half), but nothing committed
    assert set(run["step8_after_kill"]) == {"node0", "node1"}
    for names in run["step8_after_kill"].values():
        assert "manifest.json" not in names and names, names
    for r in run["peers"]:
        assert r.value["start"] == 6, r.describe()  # not the half step 8
    # the durable copy of step 8 comes after the local commit: nothing durable at 8 either
    assert run["durable_after_restart"] == [4]


def test_lost_node_recovers_from_peers_bit_exact(run):
    peers = run["peers"]
    for r in peers:
        assert r.ok, r.describe()
        assert r.value["resume"]["tier"] == "local" and r.value["resume"]["step"] == 6
        assert r.value["resume"]["fetched"] > 0  # node 1's files came from node 0
    # through the read pipeline: node 0 its own files, node 1 its shard straight from node 0
    assert peers[0].value["piped"]["local"] > 0 and peers[1].value["piped"]["streams"] > 0
    assert _records(run["root"], "peers") == _records(run["root"], "first")


def test_full_local_tier_warns_once_and_saves_durably(run):
    from shardckpt.checkpoint.run_dir import CheckpointManager

    peers = run["peers"]
    off = [w for w in peers[0].value["warnings"] if "local tier turned off" in w]
    assert len(off) == 1 and "quota" in off[0], peers[0].value["warnings"]
    for r in peers:
        assert r.value["tier_on"] is False
        assert not any("local tier turned off" in w for w in r.value["warnings"]) or r.rank == 0
    mgr = CheckpointManager(f"{run['root']}/durable")
    assert [f.step for f in mgr.committed()] == [4, 8, 12]
    assert mgr.read_latest() == "step-00000012"
    for step in (4, 8, 12):
        assert mgr.check(next(f for f in mgr.committed() if f.step == step), full=True) == []
    # nothing of a step-8 or later save went to the full tier
    assert not os.path.exists(os.path.join(run["root"], "local", "node0", "step-00000010"))


def test_resume_on_another_world_size_from_the_local_tier(run):
    for r in run["world1"]:
        assert r.ok, r.describe()
        assert r.value["start"] == 6 and r.value["resume"]["tier"] == "local", r.value
        assert r.value["same_as_plain_load"], r.value
        # the local tier's bytes are checked as any tier's: the damaged copy is refused, and the
        # previous local step is taken
        damaged = r.value["damaged"]
        assert damaged["step"] == 4 and damaged["resume"]["tier"] == "local", damaged
        assert len(damaged["warnings"]) == 1 and "shard-00001" in damaged["warnings"][0], damaged


def test_rank_lost_during_the_peer_copy_fails_every_survivor_and_commits_nothing(run):
    killed = run["copy_kill"]
    assert killed[3].exitcode == -signal.SIGKILL, killed[3].describe()
    for r in killed[:3]:
        assert r.ok, r.describe()
        message = r.value["outcome"]
        # every survivor, not only the victim's partner, sees the loss itself, not a timeout
        assert message.startswith("CollectiveError: peer copy of"), message
        assert "lost contact" in message and "committed on no node" in message, message
        assert "timed out" not in message.lower(), message
    # rank 3's files reached node 0 in part at most: step 4 has files but no manifest anywhere
    assert run["copy_kill_step4"], run["copy_kill_step4"]
    for names in run["copy_kill_step4"].values():
        assert "manifest.json" not in names, names
    restart = run["copy_kill_restart"]
    for r in restart:
        assert r.ok and r.value["outcome"] == "saved", r.describe()
        assert r.value["start"] == 2 and r.value["resume"]["tier"] == "local", r.value
    # bit-exact against the run the kill interrupted (its state after step 4, every rank)
    before = _records(os.path.join(run["root"], "copy-kill"), "state", range(4))
    assert [r.value["state"] for r in restart] == before


def _doc(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def test_durable_copy_references_the_previous_durable_frozen_files(run):
    from shardckpt.checkpoint.verify import verify

    root = os.path.join(run["root"], "frozen")
    for r in run["frozen"]:
        assert r.ok, r.describe()
    durable = os.path.join(root, "durable")
    # keep_last=2 keeps 4 and 6, and 2 too: both reference its frozen files
    assert sorted(n for n in os.listdir(durable) if n.startswith("step-")) == \
        ["step-00000002", "step-00000004", "step-00000006"]
    first = [f for f in _doc(os.path.join(durable, "step-00000002"))["files"] if f["role"] == "frozen"]
    assert len(first) == 2 and not any(f["path"].startswith("../") for f in first), first
    for step in ("step-00000004", "step-00000006"):
        here = os.path.join(durable, step)
        doc = _doc(here)
        frozen = [f for f in doc["files"] if f["role"] == "frozen"]
        # references to step 2's files (step 6 copies step 4's reference: no chain), each entry
        # as step 2 recorded it but for its path
        assert frozen == [{**f, "path": f"../step-00000002/{f['path']}"} for f in first], frozen
        # no frozen byte written below the durable checkpoint
        assert not [n for _, _, fs in os.walk(here) for n in fs if n.startswith("frozen-")]
        # the durable manifest is the node's but for those paths (and what they change)
        local = _doc(os.path.join(root, "local", "node0", step))
        mine = {f["index"]: f for f in local["files"] if f["role"] == "frozen"}
        assert [f if f["role"] != "frozen" else {**f, "path": mine[f["index"]]["path"]}
                for f in doc["files"]] == local["files"]
        drop = {"files", "manifest_crc32c", "created_at"}  # each made at its commit: a second may pass
        assert {k: v for k, v in doc.items() if k not in drop} == \
            {k: v for k, v in local.items() if k not in drop}
        result = verify(here)
        assert result.ok, result.problems
    # every agreement of the durable copies was watched (a lost rank fails every survivor)
    for r in run["frozen"]:
        durable_agreements = [a for a in r.value["agreements"] if durable in a[0]]
        assert len(durable_agreements) == 3 * 3, r.value["agreements"]
        assert all(watched for _, watched in durable_agreements), durable_agreements
        # and a resume from the durable tier alone is bit-exact
        assert r.value["start"] == 6, r.value
        assert r.value["resumed"] == r.value["state"]
