"""The node-local tier on real, small tmpfs mounts that run out of room: the kernel's ENOSPC in
the middle of a write, not a quota. The ranks run in a mount namespace of their own
(``unshare --user --map-root-user --mount``), each node's directory a tmpfs sized from the
shard it holds; the tier's own check of free space before a write is turned off in the ranks, as
when another writer takes the room between the check and the write.

One launch, 2 ranks on 2 nodes:

1. ``peer``: each node has room for its rank's own files, not for its peer's copy: the save of
   step 2 is written, its peer copy fails with ENOSPC on both receivers (each then drops the
   rest of the stream, so the sender is not left waiting); one warning turns the tier off, the
   durable save due at 2 is made from the node directories, step 4 goes to the durable tier only;
2. ``write``: a node has not room for its rank's own shard: the local write of step 5 fails
   with ENOSPC; one warning, and the durable saves of 5 and 6 are made from memory;
3. a fresh engine resumes from the durable tier of 2 at step 6, bit-exact.

In each, the tmpfs mounts hold no half-written file and no step a reader would take as committed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PG_TIMEOUT = 60
PAGE = 4096


def _build(pm):
    import torch
    from torch import nn

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # 1.6 MB of state a rank
    engine = ZeroEngine(model, process_mesh=pm, deterministic=True)
    return engine, ShardedAdamW(engine, decay_param_groups(engine, 0.0), lr=1e-2)


def _step(engine, opt, i: int, rank: int) -> None:
    import torch

    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(100 * i + rank))
    engine(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _digest(engine) -> dict:
    import hashlib

    import torch

    return {f"{g}.{k}": hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
            for g, kinds in sorted(engine.local_shards().items()) for k, t in sorted(kinds.items())}


def _mount(path: str, nbytes: int) -> None:
    os.makedirs(path, exist_ok=True)
    size = -(-nbytes // PAGE) * PAGE
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path], check=True)


def _listing(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def job(rank: int, world: int, root: str) -> dict:
    import logging

    import torch.distributed as dist

    import shardckpt.training.tiers as tiers_mod
    from shardckpt.checkpoint.run_dir import CheckpointManager
    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.runtime import init_distributed
    from shardckpt.training.checkpointer import Checkpointer

    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardckpt").addHandler(handler)
    logging.getLogger("shardckpt").setLevel(logging.INFO)
    # the room is taken between the check and the write: the kernel says ENOSPC mid-write
    tiers_mod.ensure_room = lambda *args, **kwargs: None
    pm = init_distributed(timeout_s=PG_TIMEOUT)
    engine, opt = _build(pm)
    own = sum(t.numel() * t.element_size() for kinds in engine.local_shards().values()
              for t in kinds.values())
    _mount(f"{root}/peer/node{rank}", own + own // 2)  # its own files; half its peer's
    _mount(f"{root}/write/node{rank}", own // 2)  # not even its own shard
    dist.barrier()
    out: dict = {"own": own}

    def warnings() -> list[str]:
        got = [r.getMessage() for r in records if r.levelname == "WARNING"]
        records.clear()
        return got

    for phase, steps, every, durable_every in (("peer", range(1, 5), 2, 2), ("write", range(5, 7), 1, 1)):
        tier = LocalTier(path=f"{root}/{phase}/node{{node}}", every=every, keep=2, peers=1,
                         ranks_per_node=1)
        ckpt = Checkpointer(f"{root}/durable", engine, local=tier, durable_every=durable_every,
                            keep_last=10)
        for i in steps:
            _step(engine, opt, i, rank)
            ckpt.save(i)
        ckpt.close()
        dist.barrier()
        out[phase] = {"warnings": warnings(), "tier_on": ckpt.tier.enabled,
                      "files": _listing(f"{root}/{phase}/node{rank}")}
    out["state"] = _digest(engine)
    manager = CheckpointManager(f"{root}/durable")
    out["durable"] = [[f.step, manager.check(f, full=True)] for f in manager.committed()]
    engine2, _ = _build(pm)
    again = Checkpointer(f"{root}/durable", engine2)
    out["resumed"] = {"step": again.resume(), "state": _digest(engine2)}
    again.close()
    return out


RUN = """
import json, sys
sys.path[:0] = {paths!r}
import test_tiers_tmpfs as t
from testing.ranks import run_ranks
res = run_ranks(t.job, 2, args=({root!r},), timeout_s=240, pg_timeout_s=t.PG_TIMEOUT)
json.dump([{{"value": r.value, "error": r.describe() if r.value is None else ""}} for r in res],
          open({out!r}, "w"))
"""


def _namespace() -> list[str] | None:
    """The command prefix that runs a process in a mount namespace of its own where it may
    mount a tmpfs, or None where this machine allows none."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return None
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    with tempfile.TemporaryDirectory() as d:
        probe = subprocess.run([*cmd, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d],
                               capture_output=True, timeout=30)
    return cmd if probe.returncode == 0 else None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cmd = _namespace()
    if cmd is None:
        pytest.skip("this machine lets no process mount a tmpfs in a namespace of its own "
                    "(unshare --user --mount); the quota test in test_tiers.py covers a full tier")
    root = str(tmp_path_factory.mktemp("tmpfs"))
    out = os.path.join(root, "results.json")
    code = RUN.format(paths=[HERE, ROOT], root=root, out=out)
    proc = subprocess.run([*cmd, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and os.path.exists(out), proc.stderr[-4000:]
    with open(out) as f:
        results = json.load(f)
    for r in results:
        assert r["value"] is not None, r["error"]
        r["value"]["durable"] = dict(r["value"]["durable"])  # step -> what its check found
    return [r["value"] for r in results]


def _full(ws: list[str]) -> list[str]:
    return [w for w in ws if "local tier turned off" in w]


def test_enospc_in_the_peer_copy_turns_the_tier_off_once_and_keeps_every_durable_save(run):
    r0, r1 = run
    off = _full(r0["peer"]["warnings"])
    assert len(off) == 1, r0["peer"]["warnings"]
    assert "No space left on device" in off[0] and "peer copy" in off[0], off[0]
    assert not _full(r1["peer"]["warnings"])  # rank 0 says it, for every rank
    assert not r0["peer"]["tier_on"] and not r1["peer"]["tier_on"]
    # the durable saves due at 2 (from the node directories) and 4 (durable only) are whole
    assert r0["durable"][2] == [] and r0["durable"][4] == [], r0["durable"]
    # the step-2 files were written on each node, the copy it could not take left nothing
    # half-written, and no node committed step 2: removed once the durable copy was made
    for r in run:
        assert r["peer"]["files"] == [], r["peer"]["files"]


def test_enospc_in_the_local_write_turns_the_tier_off_once_and_saves_from_memory(run):
    r0, r1 = run
    off = _full(r0["write"]["warnings"])
    assert len(off) == 1, r0["write"]["warnings"]
    assert "No space left on device" in off[0] and "local save" in off[0], off[0]
    assert not r0["write"]["tier_on"] and not r1["write"]["tier_on"]
    assert r0["durable"][5] == [] and r0["durable"][6] == [], r0["durable"]
    for r in run:  # the half-written shard is gone, and the step with it
        assert r["write"]["files"] == [], r["write"]["files"]


def test_the_durable_saves_made_around_a_full_tier_resume_bit_exact(run):
    assert sorted(run[0]["durable"]) == [2, 4, 5, 6]
    for r in run:
        assert r["resumed"]["step"] == 6
        assert r["resumed"]["state"] == r["state"]
