"""HSDP replica check at save: a bit flipped in one replica's shard fails the save, naming the
ranks, the file and the chunk; nothing is committed and ``latest`` keeps the previous step.

On a 2 x 2 mesh shard 0 is written by rank 0 (replica 0) and shard 1 by rank 3 (replica 1);
ranks 1 and 2 write no shard and compare. Each case trains the tiny Llama one step (in the
runtime's default mode for the synchronous case, deterministic mode for the async one: replicas
agree bit for bit in both), saves a clean step, then flips one bit of one rank's fp32 master shard
in memory (what a silent memory error does) and saves again:

* ``writer_sync``: the flip is on rank 3, which writes shard 1 (synchronous save);
* ``replica_async``: the flip is on rank 2, which writes nothing (async save: its CRCs are taken
  when the shards are copied aside); a flip made after that, while the write goes on, belongs to
  the next save, not this one: that save commits, and the next one is refused;
* ``local_tier``: the node-local tier's own save (2 nodes of 2 ranks), the flip on rank 3: no
  node commits the failed step and every node keeps the previous one;
* ``frozen_replica``: two linear units, the first frozen; the flip is in the frozen group on
  rank 1, which writes nothing; the writer's step-2 entry is a reference to step 1's frozen file
  (its bytes did not change), which the error names.

Each expects the error on every rank, the chunk computed here from the flipped element's byte
offset, no manifest in the failed step, ``latest`` unchanged, and a clean save once the bit is
flipped back. Runs in the shared 4-rank job (``testing.ranks.case_suite``): no launch of its own
when the suite runs together.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any
from collections.abc import Callable

import pytest

from testing.ranks import case_suite, check_case

pytestmark = pytest.mark.slow

CHUNK = 4096


def _shared_dir(pm: Any) -> str:
    from shardckpt.checkpoint.collective import broadcast_bytes

    mine = tempfile.mkdtemp(prefix="shardckpt-replica-").encode() if pm.rank == 0 else None
    return broadcast_bytes(mine, 0).decode()


def _flip(engine: Any, rank: int, who: int, frozen: bool = False) -> tuple[str, int]:
    """Flip bit 3 of an element three quarters into the largest (``frozen``: frozen) group's
    master (some chunks in) on rank ``who`` (every rank calls): (the slot's name, the element)."""
    import torch

    shards = engine.local_shards()
    grad = {g.name: g.requires_grad for g in engine.layout.groups}
    group = max(sorted(g for g in shards if grad[g] != frozen), key=lambda g: shards[g]["master"].numel())
    element = shards[group]["master"].numel() * 3 // 4
    if rank == who:
        with torch.no_grad():
            engine.local_shards()[group]["master"].view(torch.int32)[element] ^= 1 << 3
    return f"{group}.master", element


def _expected_chunk(url: str, shard: int, slot_name: str, element: int, role: str) -> int:
    """The chunk of the ``role`` file of ``shard`` holding ``element`` of ``slot_name`` (from a
    committed checkpoint of the same layout: its header size and the slot's offset)."""
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.format.manifest import frozen_slots, shard_slots

    m = CheckpointReader(url).manifest
    entry = next(f for f in m.files if f.role == role and f.index == shard)
    slots = frozen_slots(m.components, m.mesh) if role == "frozen" else \
        shard_slots(m.components, m.mesh, frozen=m.frozen)
    slot = next(s for s in slots if s.name == slot_name)
    return (entry.data_start + slot.begin + 4 * element) // CHUNK


def _latest(ckpt: Any) -> str:
    """The URL ``latest`` names, once rank 0 (which points it) has finished the save too."""
    import torch.distributed as dist

    dist.barrier()
    return ckpt.manager.latest_url() or ""


def _refused(ckpt: Any, step: int, run: str, expect: dict[str, Any], save: Callable[[], Any]
             ) -> list[str]:
    """Problems with a save that must fail the replica check (``expect``: ranks, file, chunk)."""
    from shardckpt.checkpoint.run_dir import step_dir

    problems = _raised(step, expect, save)
    if os.path.exists(f"{run}/{step_dir(step)}/manifest.json"):
        problems.append(f"step {step}: a manifest exists after the failed replica check")
    latest = _latest(ckpt)
    if not latest.endswith(step_dir(step - 1)):
        problems.append(f"step {step}: latest names {latest}, not step {step - 1}")
    return problems


def _raised(step: int, expect: dict[str, Any], save: Callable[[], Any]) -> list[str]:
    """Problems with the error of a save that must fail the replica check."""
    problems = []
    try:
        save()
    except Exception as e:  # noqa: BLE001 - what the case inspects
        text = str(e)
        if type(e).__name__ != "ReplicaMismatchError":
            problems.append(f"step {step}: {type(e).__name__}: {text}")
        want = [f"ranks {expect['ranks']}", expect["file"], f"chunk {expect['chunk']} ",
                "silent data corruption", "previous checkpoint stays the latest", *expect["also"]]
        problems += [f"step {step}: the error does not say {w!r}: {text}" for w in want if w not in text]
    else:
        problems.append(f"step {step}: a save with a flipped bit in one replica committed")
    return problems


def _frozen_engine(hsdp: Any) -> Any:
    """Two linear units, the first frozen (its bytes go to ``frozen`` files), and AdamW."""
    import torch
    from torch import nn

    from shardckpt.runtime import ShardedAdamW, ZeroEngine

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    net[0].requires_grad_(False)
    engine = ZeroEngine(net, policy=(nn.Linear,), process_mesh=hsdp, deterministic=True)
    return engine, ShardedAdamW(engine)


def _case(pm: Any, flipped: int, async_save: bool, frozen: bool = False) -> list[str]:
    from shardckpt.checkpoint.run_dir import step_dir
    from shardckpt.format.layout import Mesh
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.training.checkpointer import Checkpointer
    from testing.engines import tiny_engine, tiny_step

    hsdp = ProcessMesh.from_process_group(Mesh.hsdp(2, 2))
    if frozen:
        engine, opt = _frozen_engine(hsdp)
    else:
        # the runtime's default mode for the synchronous case: replicas agree bit for bit there too
        engine, opt = tiny_engine(hsdp, deterministic=async_save)
        tiny_step(engine, opt, 0, pm.rank)
    root = _shared_dir(pm)
    run = f"{root}/run"
    ckpt = Checkpointer(run, engine, async_save=async_save, chunk_size=CHUNK, keep_last=None)
    problems: list[str] = []
    try:
        ckpt.save(1)
        ckpt.wait()
        slot, element = _flip(engine, pm.rank, flipped, frozen)
        shard = engine.layout.mesh.shard_rank(flipped)
        role = "frozen" if frozen else "shard"
        # a frozen file is referenced from step 1 (unchanged bytes): the reference is named
        expect = {"ranks": "1, 3" if flipped in (1, 3) else "0, 2", "file": f"{role}-{shard:05d}-of-00002",
                  "also": [f"../{step_dir(1)}/"] if frozen else [],
                  "chunk": _expected_chunk(f"{run}/{step_dir(1)}", shard, slot, element, role)}
        problems += _refused(ckpt, 2, run, expect, lambda: (ckpt.save(2), ckpt.wait()))
        _flip(engine, pm.rank, flipped, frozen)  # back: the replicas agree again
        if async_save:  # a flip once the shards are copied aside belongs to the next save
            ckpt.save(3)
            ckpt.wait_staged()
            _flip(engine, pm.rank, flipped)
            ckpt.wait()
            problems += _refused(ckpt, 4, run, expect, lambda: (ckpt.save(4), ckpt.wait()))
            _flip(engine, pm.rank, flipped)
        last = 5 if async_save else 3
        ckpt.save(last)
        ckpt.wait()
        if not _latest(ckpt).endswith(step_dir(last)):
            problems.append(f"the clean save of step {last} is not the latest")
    except Exception as e:  # noqa: BLE001 - reported, the shared job goes on
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        ckpt.close()
        import torch.distributed as dist

        dist.barrier()  # every rank is done with the directory
        if pm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return problems


def case_writer_sync(pm: Any) -> list[str]:
    return _case(pm, flipped=3, async_save=False)


def case_replica_async(pm: Any) -> list[str]:
    return _case(pm, flipped=2, async_save=True)


def case_frozen_replica(pm: Any) -> list[str]:
    return _case(pm, flipped=1, async_save=False, frozen=True)


def case_local_tier(pm: Any) -> list[str]:
    """The node-local tier's own save (2 nodes of 2 ranks): the flip on rank 3, which writes
    shard 1, fails the local save of step 2 on every rank; no node holds a manifest of step 2,
    every node keeps step 1, and the clean step 3 commits on every node."""
    import torch.distributed as dist

    from shardckpt.checkpoint.run_dir import step_dir
    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.format.layout import Mesh
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.training.checkpointer import Checkpointer
    from testing.engines import tiny_engine, tiny_step

    engine, opt = tiny_engine(ProcessMesh.from_process_group(Mesh.hsdp(2, 2)))
    tiny_step(engine, opt, 0, pm.rank)
    root = _shared_dir(pm)
    nodes = [f"{root}/node{n}" for n in (0, 1)]
    tier = LocalTier(path=f"{root}/node{{node}}", every=1, keep=3, peers=1, ranks_per_node=2)
    ckpt = Checkpointer(f"{root}/run", engine, chunk_size=CHUNK, keep_last=None, local=tier,
                        durable_every=10 ** 9)
    problems: list[str] = []

    def committed(step: int) -> list[bool]:
        dist.barrier()  # every node's leader has finished with the step
        return [os.path.exists(f"{n}/{step_dir(step)}/manifest.json") for n in nodes]
    try:
        ckpt.save(1)
        ckpt.wait()
        slot, element = _flip(engine, pm.rank, 3)
        expect = {"ranks": "1, 3", "file": "shard-00001-of-00002", "also": [],
                  "chunk": _expected_chunk(f"{nodes[0]}/{step_dir(1)}", 1, slot, element, "shard")}
        problems += _raised(2, expect, lambda: (ckpt.save(2), ckpt.wait()))
        failed, kept = committed(2), committed(1)
        if any(failed):
            problems.append(f"step 2 has a manifest on a node after the failed replica check: {failed}")
        if not all(kept):
            problems.append(f"step 1 is no longer committed on every node: {kept}")
        _flip(engine, pm.rank, 3)  # back: the replicas agree again
        ckpt.save(3)
        ckpt.wait()
        clean = committed(3)
        if not all(clean):
            problems.append(f"the clean save of step 3 is not committed on every node: {clean}")
    except Exception as e:  # noqa: BLE001 - reported, the shared job goes on
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        ckpt.close()
        dist.barrier()  # every rank is done with the directory
        if pm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return problems


CASES: dict[str, Callable[..., Any]] = {"writer_sync": case_writer_sync,
                                        "replica_async": case_replica_async,
                                        "frozen_replica": case_frozen_replica,
                                        "local_tier": case_local_tier}

reports = case_suite(__name__, CASES, lambda world: list(CASES) if world == 4 else [], [4],
                     timeout_s=180)


def test_a_flipped_bit_in_the_writing_replica_fails_the_save(reports):
    check_case(reports, "writer_sync")


def test_a_flipped_bit_in_a_replica_that_writes_nothing_fails_the_async_save(reports):
    check_case(reports, "replica_async")


def test_a_flipped_bit_in_a_frozen_group_of_a_replica_fails_the_save(reports):
    check_case(reports, "frozen_replica")


def test_a_flipped_bit_in_a_replica_fails_the_local_tier_save(reports):
    check_case(reports, "local_tier")
