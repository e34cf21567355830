"""shardckpt as DCP's storage layer under real FSDP2 on gloo: save from 2 ranks, load into 1, 2, 3
ranks and an HSDP 2 x 2 mesh, bit for bit; a rank killed mid-save commits nothing.

The model and the saving, loading and killed jobs are in ``testing/fsdp2_dcp.py``: a tiny FSDP2
model whose dimensions do not divide by 2, 3 or 4 (uneven shards), AdamW over two param groups,
and a tensor-parallel ``Shard(1)`` DTensor beside them; the loading jobs compare everything they
loaded with the saving job's full reference state bit for bit. Rank functions are module level so
that spawn can import them.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from testing.fsdp2_dcp import STEPS, build, kill_job, load_job, save_job, state, train_step
from testing.ranks import run_distributed, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


# ------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    root = str(tmp_path_factory.mktemp("dcp"))
    out = run_distributed(save_job, 2, args=(root, root), timeout_s=300)
    return root, [r["next_loss"] for r in out]


@pytest.mark.parametrize("world,hsdp", [(1, False), (2, False), (3, False), (4, True)],
                         ids=["1", "2", "3", "hsdp2x2"])
def test_load_fsdp2_any_world_bit_for_bit(saved: tuple[str, list[float]], world: int,
                                          hsdp: bool) -> None:
    from shardckpt.tools.diff import diff

    root, next_losses = saved
    again = f"{root}/again-{world}{'-hsdp' if hsdp else ''}"
    out = run_distributed(load_job, world, args=(f"{root}/ck", root, hsdp, None, again),
                          timeout_s=300)
    for r in out:
        assert r["differ"] == [] and r["groups"], r
    if world == 2:  # same ranks, same batches: training continues exactly where it stopped
        assert [r["loss"] for r in out] == next_losses
    # the same state saved again from this world size: other chunks, equal content
    result = diff(f"{root}/ck", again)
    assert result.equal and result.compared > 20, result.differences


def test_async_save_loads_bit_for_bit(saved: tuple[str, list[float]]) -> None:
    root, _ = saved
    for r in run_distributed(load_job, 2, args=(f"{root}/ck-async", root), timeout_s=300):
        assert r["differ"] == [] and r["groups"], r


def test_manifest_is_json_with_blobs_and_verifies(saved: tuple[str, list[float]]) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.checkpoint.verify import verify

    root, _ = saved
    m = CheckpointReader(f"{root}/ck").manifest
    assert m.version == (1, 2) and m.chunked is not None and m.extras["step"] == STEPS
    assert [f.role for f in m.files] == ["chunks", "chunks"]
    tp = m.chunked.tensors["tp.w"]
    assert [(c.offsets, c.sizes) for c in tp.chunks] == [((0, 0), (5, 4)), ((0, 4), (5, 3))]
    assert any(k.startswith("optim.param_groups") for k in m.chunked.blobs)
    assert not list(Path(root, "ck").rglob("*.metadata")) and verify(f"{root}/ck")


def test_killed_rank_commits_nothing_and_previous_loads(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardckpt.interop.dcp.storage import ShardckptReader

    results = run_ranks(kill_job, 2, args=(str(tmp_path),), timeout_s=300, pg_timeout_s=20)
    assert not results[1].ok and results[1].exitcode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "manifest.json").exists()
    with pytest.raises(CheckpointException, match="never committed"):
        dcp.load({"x": torch.zeros(1)}, storage_reader=ShardckptReader(str(tmp_path / "killed")))
    sd = {"model": {"l1.weight": torch.zeros(10, 6)}}
    dcp.load(sd, storage_reader=ShardckptReader(str(tmp_path / "good")),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert sd["model"]["l1.weight"].abs().sum() > 0


def loop_job(rank: int, world: int, run: str, steps: int) -> dict[str, Any]:
    """A plain FSDP2 loop: resume from the newest good checkpoint, train, save every step."""
    from shardckpt.interop.dcp.checkpointer import DcpCheckpointer

    model, opt, _ = build(world, 0)
    ckpt = DcpCheckpointer(run, keep_last=2)
    sd = state(model, opt, world, 0)
    start = ckpt.load_latest(sd)
    if start is not None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    first = 0 if start is None else start
    for s in range(first, first + steps):
        train_step(model, opt, s, rank)
        ckpt.save(s + 1, state(model, opt, world, 0))
    ckpt.close()
    return {"start": start}


def test_checkpointer_latest_retention_resume_skips_damaged(tmp_path: Path) -> None:
    from shardckpt.checkpoint.verify import verify
    from shardckpt.checkpoint.run_dir import CheckpointManager

    run = str(tmp_path / "run")
    assert [r["start"] for r in run_distributed(loop_job, 2, args=(run, 3), timeout_s=300)] == [None] * 2
    mgr = CheckpointManager(run)
    assert [f.step for f in mgr.committed()] == [2, 3] and mgr.read_latest() == "step-00000003"
    # damage a byte of step 3's data and leave an uncommitted step 4: resume from step 2
    victim = sorted((tmp_path / "run" / "step-00000003").rglob("chunks-00000.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    (tmp_path / "run" / "step-00000004" / "x").mkdir(parents=True)
    assert [r["start"] for r in run_distributed(loop_job, 2, args=(run, 1), timeout_s=300)] == [2] * 2
    # the resumed run saved step 3 again, replacing the damaged one
    assert mgr.read_latest() == "step-00000003" and verify(mgr.url_for(3))


def test_consolidate_fsdp2_checkpoint_default_prefix(saved: tuple[str, list[float]],
                                                     tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from shardckpt.tools.consolidate import consolidate

    root, _ = saved
    r = consolidate(f"{root}/ck", str(tmp_path / "hf"), dtype="fp32", buffer_bytes=64)
    out = load_file(str(tmp_path / "hf" / r.files[0][0]))
    want = {k[len("model."):]: v for k, v in load_file(f"{root}/reference.safetensors").items()
            if k.startswith("model.")}
    assert set(out) == set(want) and all(torch.equal(out[k], want[k]) for k in want)
