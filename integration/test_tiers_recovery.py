"""Recovery on the node-local tier, 2 ranks on 2 simulated nodes (``{node}`` paths) on gloo: what
a resume does with damage it can work around, and that a run can save again the step it passed
over. One launch; the ranks save steps 1-3 (local every step, durable at 3), then each case
damages the checkpoints (rank 0, every rank waiting) and resumes in a fresh engine:

* ``manifest``: node 1's ``manifest.json`` of step 3 is damaged, node 0's intact, every file
  whole: the ranks resume step 3 with node 0's copy (which replaces node 1's), bit-exact;
* ``own_copy``: one bit of node 1's own shard file of step 3 is flipped, and one of node 0's
  rank file, their copies intact: the ranks resume step 3 with those copies, bit-exact, and the
  warnings name the files;
* ``passed_over``: every copy of a shard of step 3 (both nodes) and the durable step 3 are
  damaged: the ranks resume step 2, train step 3 and save it again (local and durable); every
  node and the durable tier hold the passed-over step 3 aside; a last resume takes the new
  step 3, bit-exact.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from testing.ckpt_runs import flip_bit
from testing.engines import tiny_engine, tiny_step
from testing.ranks import run_ranks

pytestmark = pytest.mark.slow

PG_TIMEOUT = 30


def _digest(engine, opt) -> dict:
    import hashlib

    import torch

    out = {f"{g}.{k}": hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
           for g, kinds in sorted(engine.local_shards().items()) for k, t in sorted(kinds.items())}
    out["opt_steps"] = [g["step"] for g in opt.optimizer_metadata()["param_groups"]]
    out["rand"] = torch.rand(2).tolist()  # the RNG state, restored from the rank files
    return out


def _damage_manifest(root: str) -> None:
    path = f"{root}/local/node1/step-00000003/manifest.json"
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x20
        f.seek(0)
        f.write(data)


def _damage_every_copy(root: str) -> None:
    for node in ("node0", "node1"):
        flip_bit(f"{root}/local/{node}/step-00000003", "shard-00000-")
    flip_bit(f"{root}/durable/step-00000003", "shard-00000-")


def _node1_step3(root: str) -> dict:
    """What node 1's step 3 holds beside its files, and whether its manifest is node 0's."""
    here = f"{root}/local/node1/step-00000003"
    with open(f"{here}/manifest.json", "rb") as a, \
            open(f"{root}/local/node0/step-00000003/manifest.json", "rb") as b:
        same = a.read() == b.read()
    return {"names": sorted(n for n in os.listdir(here) if n.startswith("manifest")), "same": same}


def _tuned(pm):
    """A frozen base (two 64x64 layers) and a small trainable adapter, and its AdamW."""
    import torch
    from torch import nn

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4, bias=False))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    engine = ZeroEngine(model, process_mesh=pm, deterministic=True)
    return engine, ShardedAdamW(engine, decay_param_groups(engine, 0.0), lr=1e-2)


def _tuned_step(engine, opt, i: int, rank: int) -> None:
    import torch

    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(100 * i + rank))
    engine(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _frozen_of(step: str) -> dict:
    """The frozen entries a local step's manifest names, and the frozen files below it."""
    with open(f"{step}/manifest.json") as f:
        named = [e["path"] for e in json.load(f)["files"] if e["role"] == "frozen"]
    return {"named": named, "files": [n for _, _, fs in os.walk(step) for n in fs if "frozen-" in n]}


def frozen_job(rank: int, pm, root: str) -> dict:
    """Local saves of steps 1-3 (keep 2, durable at 3) of a model with a frozen base, counting the
    frozen files (and their bytes) each save adds to this rank's node directory; a resume from the local
    tier; then node 1's directory is lost and a resume takes every file it needs from node 0."""
    import shutil

    import torch.distributed as dist

    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.training.checkpointer import Checkpointer

    tier = LocalTier(path=f"{root}/local/node{{node}}", every=1, keep=2, peers=1, ranks_per_node=1)
    mine = f"{root}/local/node{rank}"  # one rank a node

    def frozen_files() -> dict[str, int]:  # every frozen file in this node's directory: size
        return {os.path.join(d, n): os.path.getsize(os.path.join(d, n))
                for d, _, names in os.walk(mine) for n in names if "frozen-" in n}

    def fresh():
        engine, opt = _tuned(pm)
        return engine, opt, Checkpointer(f"{root}/durable", engine, local=tier, durable_every=3,
                                         keep_last=2)
    engine, opt, ckpt = fresh()
    out: dict = {"per_save": []}
    for i in (1, 2, 3):
        _tuned_step(engine, opt, i, rank)
        before = frozen_files()  # each file's name carries its save's id: a new file is new
        ckpt.save(i)
        ckpt.wait()
        dist.barrier()  # the peer's copy into this node is committed with the step
        new = {p: n for p, n in frozen_files().items() if p not in before}
        out["per_save"].append({"frozen": sum(new.values()), "files": len(new)})
    ckpt.close()
    state = _digest(engine, opt)
    for name in ("local", "peers"):
        if name == "peers":
            dist.barrier()
            out["steps"] = {n: sorted(d for d in os.listdir(f"{root}/local/{n}") if d.startswith("step-"))
                            for n in ("node0", "node1")}
            out["frozen_of"] = {f"{n}/{d}": _frozen_of(f"{root}/local/{n}/{d}")
                                for n in ("node0", "node1") for d in ("step-00000002", "step-00000003")}
            dist.barrier()
            if rank == 0:
                shutil.rmtree(f"{root}/local/node1")  # node 1 lost its memory
            dist.barrier()
        engine, opt, ckpt = fresh()
        out[name] = {"start": ckpt.resume(), "resume": ckpt.last_resume}
        out[name]["same"] = _digest(engine, opt) == state
        if name == "peers":  # node 1 lacks node 0's frozen file of step 1: this save writes it
            _tuned_step(engine, opt, 4, rank)
            ckpt.save(4)
            ckpt.wait()
            state = _digest(engine, opt)
            ckpt.close()
            engine, opt, ckpt = fresh()
            out["after"] = {"start": ckpt.resume(), "same": _digest(engine, opt) == state}
        ckpt.close()
    return out


def job(rank: int, world: int, root: str) -> dict:
    import logging

    import torch.distributed as dist

    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.runtime import init_distributed
    from shardckpt.training.checkpointer import Checkpointer

    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardckpt").addHandler(handler)
    logging.getLogger("shardckpt").setLevel(logging.INFO)
    pm = init_distributed(timeout_s=PG_TIMEOUT)
    try:
        frozen = frozen_job(rank, pm, f"{root}/frozen")
    except Exception as e:  # noqa: BLE001 - what the test inspects
        frozen = {"error": f"{type(e).__name__}: {e}"}
    tier = LocalTier(path=f"{root}/local/node{{node}}", every=1, keep=3, peers=1, ranks_per_node=1)

    def fresh():
        engine, opt = tiny_engine(pm)
        return engine, opt, Checkpointer(f"{root}/durable", engine, local=tier, durable_every=3,
                                         keep_last=3)

    engine, opt, ckpt = fresh()
    for i in (1, 2, 3):
        tiny_step(engine, opt, i, pm.rank)
        ckpt.save(i)
    ckpt.close()
    saved = _digest(engine, opt)
    out: dict = {"frozen": frozen}
    for name, damage in (("manifest", _damage_manifest), ("own_copy", None),
                         ("passed_over", _damage_every_copy)):
        if rank == 0 and damage is not None:
            damage(root)
        if rank == 0 and name == "own_copy":  # a shard file on node 1, a rank file on node 0
            out["flipped"] = [flip_bit(f"{root}/local/node1/step-00000003", "shard-00001-"),
                              flip_bit(f"{root}/local/node0/step-00000003", "rank-00000")]
        dist.barrier()
        seen = len(records)
        try:
            engine, opt, ckpt = fresh()
            case: dict = {"start": ckpt.resume(), "resume": ckpt.last_resume}
            case["same"] = _digest(engine, opt) == saved
            if name == "passed_over":  # the step passed over is saved again, locally and durably
                tiny_step(engine, opt, 3, pm.rank)
                ckpt.save(3)
                ckpt.wait()
                saved = _digest(engine, opt)
                ckpt.close()
                engine, opt, ckpt = fresh()
                case["again"] = ckpt.resume()
                case["again_same"] = _digest(engine, opt) == saved
            ckpt.close()
        except Exception as e:  # noqa: BLE001 - what the test inspects
            case = {"error": f"{type(e).__name__}: {e}"}
        case["warnings"] = [r.getMessage() for r in records[seen:] if r.levelname == "WARNING"]
        if name == "manifest" and rank == 0:
            case["node1"] = _node1_step3(root)
        out[name] = case
        if "error" in case:
            break  # the group may be broken: later cases would only wait for its timeout
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("recovery"))
    results = run_ranks(job, 2, args=(root,), timeout_s=300, pg_timeout_s=PG_TIMEOUT)
    return {"root": root, "ranks": results}


def _case(run, name: str) -> list[dict]:
    out = []
    for r in run["ranks"]:
        assert r.ok, r.describe()
        assert name in r.value, r.value
        out.append(r.value[name])
    return out


def test_a_damaged_manifest_on_one_node_uses_the_intact_copy(run):
    for c in _case(run, "manifest"):
        assert "error" not in c, c
        assert c["start"] == 3 and c["resume"]["tier"] == "local", c
        assert c["same"], c  # bit-exact: masters, moments, optimizer steps, RNG
    # node 1's damaged copy is kept beside the intact one that replaced it
    node1 = _case(run, "manifest")[0]["node1"]
    assert node1 == {"names": ["manifest.json", "manifest.json.damaged-1"], "same": True}, node1


def test_a_damaged_own_copy_is_replaced_by_its_peer_copy_file_by_file(run):
    for c in _case(run, "own_copy"):
        assert "error" not in c, c
        assert c["start"] == 3 and c["resume"]["tier"] == "local", c  # the same step
        assert c["resume"]["fetched"] >= 1, c  # those files, from the other node
        assert c["same"], c  # the RNG state too, from node 1's copy of rank 0's file
    for flipped, node in zip(run["ranks"][0].value["flipped"], (1, 0), strict=True):
        name = os.path.basename(flipped)
        warnings = _case(run, "own_copy")[node]["warnings"]  # said by a rank of that node
        assert [w for w in warnings if name in w and "moved aside" in w], warnings
        # the damaged copy is kept beside (since put aside with its step by the last case)
        assert glob.glob(f"{run['root']}/local/node{node}/**/{name}.damaged-1", recursive=True)


def test_a_passed_over_step_is_put_aside_on_every_node_and_tier_and_saved_again(run):
    for c in _case(run, "passed_over"):
        assert "error" not in c, c
        assert c["start"] == 2 and c["resume"]["tier"] == "local", c
        assert c["same"] is False  # step 2, not the state after step 3
        assert c["again"] == 3 and c["again_same"], c
    root = run["root"]
    for where in ("local/node0", "local/node1", "durable"):
        notes = glob.glob(f"{root}/{where}/passed-over/step-00000003.*/passed-over.json")
        assert len(notes) == 1, (where, os.listdir(f"{root}/{where}"))
        with open(notes[0]) as f:
            why = json.load(f)["why"]
        assert "checksums" in why, (where, why)
        assert os.path.exists(f"{root}/{where}/step-00000003/manifest.json")  # the new save
    # one warning per place (node 1's from its leader, rank 1), each saying why
    said = [w for c in _case(run, "passed_over") for w in c["warnings"] if "was passed over at resume" in w]
    assert len(said) == 3 and all("checksums" in w for w in said), said


def test_local_saves_reference_unchanged_frozen_files_instead_of_writing_them(run):
    from shardckpt.checkpoint.verify import verify

    root = f"{run['root']}/frozen"
    for c in _case(run, "frozen"):
        assert "error" not in c, c
        # the first save writes this rank's frozen file and its peer's copy; the next two none
        first, *later = c["per_save"]
        assert first["frozen"] > 0 and first["files"] == 2, c["per_save"]
        assert later == [{"frozen": 0, "files": 0}] * 2, c["per_save"]
        for name in ("local", "peers"):  # each node's own copies, then node 0's for node 1
            assert c[name]["start"] == 3 and c[name]["resume"]["tier"] == "local", c[name]
            assert c[name]["same"], c[name]  # bit-exact
        assert c["peers"]["resume"]["fetched"] > 0, c["peers"]
        # the save after it writes the frozen files again (node 1 no longer held node 0's), and
        # its resume is bit-exact
        assert c["after"] == {"start": 4, "same": True}, c["after"]
        # keep=2 keeps steps 2 and 3, and step 1 too: they reference its frozen files
        assert c["steps"] == {n: ["step-00000001", "step-00000002", "step-00000003"]
                              for n in ("node0", "node1")}, c["steps"]
        # steps 2 and 3 name step 1's frozen files on both nodes, and hold none of their own
        for where, got in c["frozen_of"].items():
            assert got["files"] == [], (where, got)
            assert len(got["named"]) == 2 and all(p.startswith("../step-00000001/")
                                                  for p in got["named"]), (where, got)
    # the durable copy of step 3 holds the frozen files themselves (no durable step 1 to name)
    durable = f"{root}/durable/step-00000003"
    assert len([n for _, _, fs in os.walk(durable) for n in fs if n.startswith("frozen-")]) == 2
    assert verify(durable).ok
