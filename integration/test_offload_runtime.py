"""Optimizer offload (``"cpu"``, ``"nvme"``) on real gloo process groups: masters and moments
bit for bit equal to the resident run at stages 1, 2 and 3, with the step after backward or
overlapping it; checkpoints saved and loaded with offload on or off; async saves from a
snapshot of the offload files (2 ranks). The cases run in the job of each world size that
``integration/test_save_load.py`` runs too (:mod:`testing.save_runs`: one launch per size for
both modules; parity at 1 to 4 ranks); a report is a list of problems (empty = pass).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from testing.engines import shard_state
from testing.ranks import check_case, run_cases, selected_modules
from testing.save_runs import register, world_reports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)


def _tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, TINY["vocab_size"], (2, 8), generator=g)


@contextlib.contextmanager
def _shared_dir(pm: Any, name: str) -> Iterator[Path]:
    """A directory every rank names alike (rank 0 picks it), empty at the start; removed by
    rank 0 once every rank is done with it."""
    box = [tempfile.mkdtemp(prefix=f"shardckpt-offload-{name}-") if pm.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    try:
        yield Path(box[0])
    finally:
        dist.barrier()
        if pm.rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def _build(pm: Any, stage: int, mode: str | None, where: Path | None, overlap: bool = False,
           bf16: bool = False):
    from shardckpt.runtime import MixedPrecisionPolicy, ShardedAdamW, ZeroEngine
    from shardckpt.runtime import decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw: dict[str, Any] = {}
    if bf16:
        kw["mixed_precision"] = MixedPrecisionPolicy(torch.bfloat16)
    if mode is not None:
        kw["offload_optimizer"] = mode
    if mode == "nvme":
        kw["offload_dir"] = where
    if overlap:
        kw["offload_overlap_step"] = True
    engine = ZeroEngine(LlamaForCausalLM(LlamaConfig(**TINY)), policy=LLAMA_POLICY,
                        process_mesh=pm, stage=stage, deterministic=True, **kw)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2, betas=(0.9, 0.95))
    return engine, opt


def _train(engine: Any, opt: Any, steps: range, rank: int) -> list[float]:
    from shardckpt.runtime.models.llama import causal_lm_loss

    losses = []
    for s in steps:
        tokens = _tokens(s, rank)
        loss = causal_lm_loss(engine(tokens), tokens)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses



def _diff(a: dict, b: dict, what: str) -> list[str]:
    if a.keys() != b.keys():
        return [f"{what}: kinds {sorted(a)} vs {sorted(b)}"]
    return [f"{what}: {k} differs" for k in a if not torch.equal(a[k], b[k])]


def _bf16_parity(pm: Any, stage: int, where: Path) -> list[str]:
    """bf16 compute: offloaded, the device holds the bf16 shards alone; the masters, moments
    and losses are the resident run's."""
    engine, opt = _build(pm, stage, None, None, bf16=True)
    losses = _train(engine, opt, range(3), pm.rank)
    want, problems = shard_state(engine), []
    for mode, overlap in (("cpu", False), ("nvme", True)):
        engine, opt = _build(pm, stage, mode, where, overlap, bf16=True)
        what = f"bf16 stage {stage} {mode} overlap={overlap}"
        if _train(engine, opt, range(3), pm.rank) != losses:
            problems.append(f"{what}: losses differ")
        problems += _diff(want, shard_state(engine), what)
        if any(g.master is not None or g.shard.dtype != torch.bfloat16
               for g in engine.groups.values()):
            problems.append(f"{what}: an fp32 master is on the device")
        engine.close()
    return problems


def case_parity(pm: Any) -> list[str]:
    """Stages 1-3: cpu and nvme offload, the step after backward or overlapping it, give the
    resident run's masters and moments; at 2 ranks with bf16 compute too."""
    where = Path(tempfile.mkdtemp(prefix="shardckpt-offload-parity-"))
    problems = []
    try:
        for stage in (1, 2, 3):
            engine, opt = _build(pm, stage, None, None)
            _train(engine, opt, range(3), pm.rank)
            want = shard_state(engine)
            for mode, overlap in (("cpu", False), ("nvme", False), ("cpu", True), ("nvme", True)):
                engine, opt = _build(pm, stage, mode, where, overlap)
                _train(engine, opt, range(3), pm.rank)
                problems += _diff(want, shard_state(engine), f"stage {stage} {mode} overlap={overlap}")
                engine.close()
            if pm.world_size == 2:
                problems += _bf16_parity(pm, stage, where)
        if os.listdir(where):
            problems.append(f"left in the offload directory: {os.listdir(where)}")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return problems


def case_checkpoint(pm: Any) -> list[str]:
    """Save from nvme-offloaded state, load with offload on and off; save from a resident run
    and load into an offloaded one; training on gives the same bits."""
    from shardckpt.training.save_load import load, save

    problems = []
    with _shared_dir(pm, "ckpt") as root:
        src, opt = _build(pm, 3, "nvme", root / f"off-src-{pm.rank}")
        _train(src, opt, range(2), pm.rank)
        save(src, str(root / "from-nvme"))
        ref, ref_opt = _build(pm, 2, None, None)
        _train(ref, ref_opt, range(2), pm.rank)
        save(ref, str(root / "resident"))
        _train(src, opt, range(2, 3), pm.rank)
        after = shard_state(src)
        for url, mode, stage in (("from-nvme", None, 2), ("from-nvme", "cpu", 1),
                                 ("resident", "nvme", 3)):
            dst, dst_opt = _build(pm, stage, mode, root / f"off-dst-{pm.rank}")
            load(dst, str(root / url))
            problems += _diff(shard_state(ref), shard_state(dst), f"{url} into {mode} at load")
            _train(dst, dst_opt, range(2, 3), pm.rank)
            if url == "from-nvme":
                problems += _diff(after, shard_state(dst), f"{url} into {mode} after a step")
            dst.close()
        src.close()
    return problems


def _shard_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(ckpt.glob("*/shard-*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


def case_async_save(pm: Any) -> list[str]:
    """An async Checkpointer save with nvme offload (snapshots on the offload disk) holds the
    bytes of a sync save; a snapshot failing on one rank fails the save on every rank, commits
    nothing and leaves no snapshot."""
    from shardckpt.runtime.offload import files as offload_files
    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.training.save_load import save

    problems: list[str] = []
    with _shared_dir(pm, "async") as root:
        engine, opt = _build(pm, 3, "nvme", root / f"off-{pm.rank}")
        run_dir = opt._offload.run_dir
        _train(engine, opt, range(2), pm.rank)
        save(engine, str(root / "sync"))
        ckpt = Checkpointer(str(root / "run"), engine, async_save=True)
        ckpt.save(2)
        _train(engine, opt, range(2, 3), pm.rank)  # the live files change meanwhile
        ckpt.wait()
        real = offload_files._copy_range
        if pm.rank == 1:
            def full(src: int, dst: int, nbytes: int, path: Any) -> None:
                raise OSError(28, "No space left on device")
            offload_files._copy_range = full
        ckpt.save(3)
        try:
            ckpt.wait()
            problems.append("the save with a failed snapshot on rank 1 did not fail")
        except Exception as e:  # noqa: BLE001 - the failure every rank must see
            if "No space left" not in str(e):
                problems.append(f"unexpected error: {e}")
        finally:
            offload_files._copy_range = real
        ckpt.close()
        if ckpt.manager.is_committed(3):
            problems.append("step 3 committed although rank 1 failed")
        left = [p.name for p in run_dir.iterdir() if p.name.startswith("snapshot-")]
        if left:
            problems.append(f"snapshots left: {left}")
        dist.barrier()
        if pm.rank == 0:
            want = _shard_tensors(root / "sync")
            got = _shard_tensors(root / "run" / "step-00000002")
            if not want or want.keys() != got.keys():
                problems.append(f"tensors {sorted(want)[:3]} vs {sorted(got)[:3]}")
            problems += [f"{k} differs from the sync save" for k in want
                         if k in got and not torch.equal(want[k], got[k])]
        engine.close()
    return problems


CASES: dict[str, Callable] = {"parity": case_parity, "checkpoint": case_checkpoint,
                              "async_save": case_async_save}


def cases_for(world: int) -> list[str]:
    return {1: ["parity", "checkpoint"], 2: list(CASES)}.get(world, ["parity"])


def run(rank: int, world: int, root: str, names: list[str]) -> dict[str, Any]:
    """This module's part of the job of each world size."""
    return run_cases(CASES, names, timeout_s=120)


register(__name__, "run", cases_for)


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"world{n}")
def reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, list[Any]]:
    return world_reports(__name__, request.param, tmp_path_factory,
                         selected_modules(request.session))


def test_offload_cpu_and_nvme_bit_exact_at_every_stage(reports):
    check_case(reports, "parity")


def test_checkpoints_with_offload_on_or_off_bit_for_bit(reports):
    check_case(reports, "checkpoint")


def test_async_save_with_nvme_snapshots_equals_a_sync_save_and_fails_together(reports):
    check_case(reports, "async_save")
