"""shardckpt as DCP's storage layer under real FSDP2 on gloo: save from 2 ranks, load into 1, 2, 3
ranks and an HSDP 2 x 2 mesh, bit for bit; a rank killed mid-save commits nothing.

The model and the saving, loading and killed jobs are in ``testing/fsdp2_dcp.py``: a tiny FSDP2
model whose dimensions do not divide by 2, 3 or 4 (uneven shards), AdamW over two param groups,
and a tensor-parallel ``Shard(1)`` DTensor beside them; the loading jobs compare everything they
loaded with the saving job's full reference state bit for bit. The launches are shared with
``test_dcp_interop.py`` (``testing/dcp_runs.py``: one launch per world size and stage, several
scenarios run one after another in it); each test asserts on its scenarios' results.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from testing.dcp_runs import Runs, shared_runs
from testing.fsdp2_dcp import STEPS

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return shared_runs(request, tmp_path_factory)


@pytest.mark.parametrize("world,hsdp", [(1, False), (2, False), (3, False), (4, True)],
                         ids=["1", "2", "3", "hsdp2x2"])
def test_load_fsdp2_any_world_bit_for_bit(runs: Runs, world: int, hsdp: bool) -> None:
    from shardckpt.tools.diff import diff

    out = runs["load-hsdp" if hsdp else f"load-{world}"]
    root = runs.dir("dcp")
    for r in out:
        assert r["differ"] == [] and r["groups"], r
    if world == 2:  # same ranks, same batches: training continues exactly where it stopped
        assert [r["loss"] for r in out] == [r["next_loss"] for r in runs["save"]]
    # the same state saved again from this world size: other chunks, equal content
    result = diff(f"{root}/ck", f"{root}/again-{world}{'-hsdp' if hsdp else ''}")
    assert result.equal and result.compared > 20, result.differences


def test_async_save_loads_bit_for_bit(runs: Runs) -> None:
    for r in runs["async"]:
        assert r["differ"] == [] and r["groups"], r


def test_manifest_is_json_with_blobs_and_verifies(runs: Runs) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.checkpoint.verify import verify

    runs.ran("save")
    root = runs.dir("dcp")
    m = CheckpointReader(f"{root}/ck").manifest
    assert m.version == (1, 2) and m.chunked is not None and m.extras["step"] == STEPS
    assert [f.role for f in m.files] == ["chunks", "chunks"]
    tp = m.chunked.tensors["tp.w"]
    assert [(c.offsets, c.sizes) for c in tp.chunks] == [((0, 0), (5, 4)), ((0, 4), (5, 3))]
    assert any(k.startswith("optim.param_groups") for k in m.chunked.blobs)
    assert not list(Path(root, "ck").rglob("*.metadata")) and verify(f"{root}/ck")


def test_killed_rank_commits_nothing_and_previous_loads(runs: Runs) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardckpt.interop.dcp.storage import ShardckptReader

    results = runs.kill_ranks()  # the save during which rank 1 is SIGKILLed ends its launch
    root = Path(runs.dir("kill"))
    assert not results[1].ok and results[1].exitcode == -signal.SIGKILL
    assert not (root / "killed" / "manifest.json").exists()
    with pytest.raises(CheckpointException, match="never committed"):
        dcp.load({"x": torch.zeros(1)}, storage_reader=ShardckptReader(str(root / "killed")))
    sd = {"model": {"l1.weight": torch.zeros(10, 6)}}
    dcp.load(sd, storage_reader=ShardckptReader(str(root / "good")),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert sd["model"]["l1.weight"].abs().sum() > 0


def test_checkpointer_latest_retention_resume_skips_damaged(runs: Runs) -> None:
    """The plain FSDP2 loop (``testing.dcp_runs.loop_job``) saves steps 1-3; step 3's data is
    damaged and an uncommitted step 4 left; the loop, started again, resumes from step 2."""
    from shardckpt.checkpoint.run_dir import CheckpointManager
    from shardckpt.checkpoint.verify import verify

    assert [r["start"] for r in runs["loop"]] == [None] * 2
    # as the first loop left it, before the damage
    assert runs.host["loop-committed"] == [2, 3] and runs.host["loop-latest"] == "step-00000003"
    assert [r["start"] for r in runs["loop-resume"]] == [2] * 2
    # the resumed run saved step 3 again, replacing the damaged one
    mgr = CheckpointManager(f"{runs.dir('loop')}/run")
    assert mgr.read_latest() == "step-00000003" and verify(mgr.url_for(3))


def test_consolidate_fsdp2_checkpoint_default_prefix(runs: Runs, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from shardckpt.tools.consolidate import consolidate

    runs.ran("save")
    root = runs.dir("dcp")
    r = consolidate(f"{root}/ck", str(tmp_path / "hf"), dtype="fp32", buffer_bytes=64)
    out = load_file(str(tmp_path / "hf" / r.files[0][0]))
    want = {k[len("model."):]: v for k, v in load_file(f"{root}/reference.safetensors").items()
            if k.startswith("model.")}
    assert set(out) == set(want) and all(torch.equal(out[k], want[k]) for k in want)
