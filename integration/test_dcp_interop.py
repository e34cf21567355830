"""One checkpoint across runtimes, under real FSDP2 on gloo.

* A checkpoint DCP's own ``FileSystemWriter`` wrote from 2 ranks is imported (``shardckpt import
  dcp``) and loads through :class:`shardckpt.interop.dcp_storage.ShardckptReader` into 3 ranks; exported back
  (``shardckpt export dcp``), stock ``dcp.load`` + ``set_state_dict`` read it into 1, 2 and 3.
* FSDP2 (stock DCP, 2 ranks) -> ``import dcp --ranks 3`` -> ``ZeroEngine`` on 3 ranks.
* ``ZeroEngine`` (2 ranks) -> FSDP2 on 3 ranks, through ``ShardckptReader`` (no conversion) and
  through its DCP export with stock ``dcp.load``.

Weights and Adam moments bit for bit, param groups equal, and training continues: global mean
losses of the next steps equal the source runtime's own continuation to the relative 1e-6 the
ZeroEngine/FSDP2 comparison (test_runtime_fsdp2.py) states for fp32.

The model, optimizer and state layout are those of integration/test_dcp_fsdp2.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from testing.ckpts import flat_state
from testing.fsdp2_dcp import (
    STEPS, build, compare_with_reference, full_state, load_job, state, tp_tensor, train_step,
)
from testing.models import BETAS, LR, TINY, WD, tiny_llama, tiny_loss, two_groups
from testing.ranks import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def stock_save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train, save with DCP's own FileSystemWriter to ``root/stock``, write the reference."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    model, opt, _ = build(world, 0)
    for s in range(STEPS):
        train_step(model, opt, s, rank)
    dcp.save(state(model, opt, world, 0), checkpoint_id=f"{root}/stock")
    flat, groups = full_state(model, opt)
    full_tp = tp_tensor(world, 0).full_tensor()
    if rank == 0:
        flat["tp.w"] = full_tp
        save_file(flat, f"{root}/reference.safetensors")
        Path(root, "reference.json").write_text(json.dumps(groups))
    return {"next_loss": train_step(model, opt, STEPS, rank)}


def stock_load_job(rank: int, world: int, path: str, ref: str) -> dict[str, Any]:
    """Stock ``dcp.load(checkpoint_id=path)`` into a fresh FSDP2 model; compare; train a step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, _ = build(world, 1)
    train_step(model, opt, 99, rank)
    sd = state(model, opt, world, 1)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return compare_with_reference(model, opt, sd, ref, rank)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """A stock DCP checkpoint from 2 FSDP2 ranks, imported, and exported back."""
    from shardckpt.interop.dcp_export import export_dcp
    from shardckpt.interop.dcp_import import import_dcp

    root = str(tmp_path_factory.mktemp("interop"))
    out = run_distributed(stock_save_job, 2, args=(root,), timeout_s=300)
    import_dcp(f"{root}/stock", f"{root}/ck")
    export_dcp(f"{root}/ck", f"{root}/exported")
    return root, [r["next_loss"] for r in out]


def test_imported_stock_checkpoint_loads_through_shardckpt_reader(
        imported: tuple[str, list[float]]) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.checkpoint.verify import verify

    root, _ = imported
    m = CheckpointReader(f"{root}/ck").manifest
    assert m.chunked is not None and len(m.files) == 2 and verify(f"{root}/ck")
    assert [(c.offsets, c.sizes) for c in m.chunked.tensors["tp.w"].chunks] == \
        [((0, 0), (5, 4)), ((0, 4), (5, 3))]
    for r in run_distributed(load_job, 3, args=(f"{root}/ck", root), timeout_s=300):
        assert r["differ"] == [] and r["groups"], r


@pytest.mark.parametrize("world", [1, 2, 3])
def test_exported_checkpoint_loads_with_stock_dcp(imported: tuple[str, list[float]],
                                                  world: int) -> None:
    root, next_losses = imported
    assert sorted(p.name for p in Path(root, "exported").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    out = run_distributed(stock_load_job, world, args=(f"{root}/exported", root), timeout_s=300)
    for r in out:
        assert r["differ"] == [] and r["groups"], r
    if world == 2:  # same ranks, same batches: training continues exactly where it stopped
        assert [r["loss"] for r in out] == next_losses


# ------------------------------------------------ FSDP2 (stock DCP) -> ZeroEngine (import --ranks)

LLAMA_STEPS, NEXT_STEPS, ROWS = 2, 2, 6  # ROWS: the global batch, split evenly over 2 or 3 ranks


def global_rows(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    rows = torch.randint(0, TINY["vocab_size"], (ROWS, 8), generator=g)
    per = ROWS // world
    return rows[rank * per:(rank + 1) * per]


def _mean_loss(forward: Any, opt: Any, step: int, rank: int, world: int) -> float:
    import torch.distributed as dist

    tokens = global_rows(step, rank, world)
    loss = tiny_loss(forward(tokens), tokens, 1)
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / world


def fsdp2_llama_job(rank: int, world: int, root: str) -> list[float]:
    """FSDP2 Llama (tied head), AdamW in two groups; save with stock DCP after LLAMA_STEPS,
    write the gathered reference, then continue NEXT_STEPS (global mean losses)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardckpt.interop.dcp_storage import ShardckptWriter
    from shardckpt.runtime.llama import LlamaDecoderLayer

    mesh = init_device_mesh("cpu", (world,))
    model = tiny_llama()
    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(two_groups(model.named_parameters(), WD), lr=LR, betas=BETAS,
                            foreach=False)
    for s in range(LLAMA_STEPS):
        _mean_loss(model, opt, s, rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/llama")
    dcp.save({"model": msd, "optim": osd}, storage_writer=ShardckptWriter(f"{root}/llama-chunked"))
    flat, groups = full_state(model, opt)
    if rank == 0:
        save_file(flat, f"{root}/llama-reference.safetensors")
        Path(root, "llama-reference.json").write_text(json.dumps(groups))
    return [_mean_loss(model, opt, s, rank, world) for s in range(LLAMA_STEPS, LLAMA_STEPS + NEXT_STEPS)]


def engine_job(rank: int, world: int, ckpt: str, mode: str) -> list[float]:
    """ZeroEngine (other init, lr 1.0: all must come from the checkpoint): load flat groups
    (``mode="flat"``) or chunked tensors (``"chunked"``), save what it holds to ``<ckpt>-resaved``,
    continue."""
    from shardckpt.training.chunked_load import load_chunked
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups, init_distributed
    from shardckpt.runtime.llama import LLAMA_POLICY
    from shardckpt.training.save_load import load, save

    engine = ZeroEngine(tiny_llama(seed=7), policy=LLAMA_POLICY,
                        process_mesh=init_distributed(timeout_s=60))
    opt = ShardedAdamW(engine, decay_param_groups(engine, WD), lr=1.0)
    (load if mode == "flat" else load_chunked)(engine, ckpt)
    save(engine, f"{ckpt}-resaved")
    return [_mean_loss(engine, opt, s, rank, world) for s in range(LLAMA_STEPS, LLAMA_STEPS + NEXT_STEPS)]


@pytest.fixture(scope="module")
def llama_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """FSDP2 on 2 ranks saved with stock DCP and through ShardckptWriter; its next losses."""
    root = str(tmp_path_factory.mktemp("llama"))
    return root, run_distributed(fsdp2_llama_job, 2, args=(root,), timeout_s=300)[0]


def assert_engine_state_is_reference(root: str, ckpt: str) -> None:
    from safetensors.torch import load_file

    from shardckpt.checkpoint.reader import CheckpointReader

    m = CheckpointReader(ckpt).manifest
    want = load_file(f"{root}/llama-reference.safetensors")
    for p in m.components["model"].layout.params:
        for kind, key in (("master", f"model.{p.fqn}"), ("exp_avg", f"optim.{p.fqn}.exp_avg"),
                          ("exp_avg_sq", f"optim.{p.fqn}.exp_avg_sq")):
            got = flat_state(ckpt, p.fqn, kind)
            assert torch.equal(got.view(torch.int32), want[key].view(torch.int32)), (p.fqn, kind)
    want_groups = json.loads(Path(root, "llama-reference.json").read_text())
    assert m.optimizer is not None and m.optimizer.name == "adamw"
    assert [(sorted(g["params"]), g["hparams"]["weight_decay"], g["hparams"]["lr"], g["step"])
            for g in m.optimizer.param_groups] == \
        [(sorted(w["params"]), w["weight_decay"], w["lr"], LLAMA_STEPS) for w in want_groups]


def test_fsdp2_stock_checkpoint_imports_for_zero_engine_at_3_ranks(
        llama_fsdp2: tuple[str, list[float]]) -> None:
    from shardckpt.interop.dcp_to_flat import import_dcp_flat

    root, fsdp2 = llama_fsdp2
    m = import_dcp_flat(f"{root}/llama", f"{root}/flat", 3)
    comp = m.components["model"]
    assert comp.aliases == {"lm_head.weight": "model.embed_tokens.weight"} and not comp.buffers
    assert_engine_state_is_reference(root, f"{root}/flat")
    ours = run_distributed(engine_job, 3, args=(f"{root}/flat", "flat"), timeout_s=300)[0]
    assert_engine_state_is_reference(root, f"{root}/flat-resaved")
    assert ours == pytest.approx(fsdp2, rel=1e-6), (ours, fsdp2)


def test_zero_engine_loads_fsdp2_chunked_checkpoint_at_3_ranks(
        llama_fsdp2: tuple[str, list[float]]) -> None:
    root, fsdp2 = llama_fsdp2
    ckpt = f"{root}/llama-chunked"
    ours = run_distributed(engine_job, 3, args=(ckpt, "chunked"), timeout_s=300)[0]
    assert_engine_state_is_reference(root, f"{ckpt}-resaved")
    assert ours == pytest.approx(fsdp2, rel=1e-6), (ours, fsdp2)


# ------------------------------- ZeroEngine -> FSDP2 through ShardckptReader (no conversion step)


def engine_save_job(rank: int, world: int, root: str) -> list[float]:
    """ZeroEngine, LLAMA_STEPS steps, shardckpt.save; then NEXT_STEPS more (global mean losses)."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups, init_distributed
    from shardckpt.runtime.llama import LLAMA_POLICY
    from shardckpt.training.save_load import save

    engine = ZeroEngine(tiny_llama(), policy=LLAMA_POLICY, process_mesh=init_distributed(timeout_s=60))
    opt = ShardedAdamW(engine, decay_param_groups(engine, WD), lr=LR, betas=BETAS)
    for s in range(LLAMA_STEPS):
        _mean_loss(engine, opt, s, rank, world)
    save(engine, f"{root}/zero")
    return [_mean_loss(engine, opt, s, rank, world) for s in range(LLAMA_STEPS, LLAMA_STEPS + NEXT_STEPS)]


def fsdp2_from_flat_job(rank: int, world: int, root: str, via: str) -> dict[str, Any]:
    """FSDP2 (other init, other lr) loads the ZeroEngine checkpoint through ShardckptReader
    (``via="reader"``) or its DCP export with stock ``dcp.load`` (``via="export"``)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardckpt.interop.dcp_storage import ShardckptReader
    from shardckpt.runtime.llama import LlamaDecoderLayer

    mesh = init_device_mesh("cpu", (world,))
    model = tiny_llama(seed=3)
    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(two_groups(model.named_parameters(), 0.3), lr=0.5, foreach=False)
    _mean_loss(model, opt, 99, rank, world)  # optimizer state exists and differs
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    if via == "reader":
        dcp.load(sd, storage_reader=ShardckptReader(f"{root}/zero"))
    else:
        dcp.load(sd, checkpoint_id=f"{root}/zero-exported")
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    flat, groups = full_state(model, opt)
    if rank == 0:
        save_file(flat, f"{root}/fsdp2-loaded-{via}.safetensors")
    losses = [_mean_loss(model, opt, s, rank, world) for s in range(LLAMA_STEPS, LLAMA_STEPS + NEXT_STEPS)]
    return {"groups": groups, "losses": losses}


@pytest.fixture(scope="module")
def zero_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """A ZeroEngine checkpoint from 2 ranks, its DCP export, and the engine's next losses."""
    from shardckpt.interop.dcp_export import export_dcp

    root = str(tmp_path_factory.mktemp("zero"))
    theirs = run_distributed(engine_save_job, 2, args=(root,), timeout_s=300)[0]
    export_dcp(f"{root}/zero", f"{root}/zero-exported")
    return root, theirs


@pytest.mark.parametrize("via", ["reader", "export"])
def test_zero_engine_checkpoint_loads_into_fsdp2_at_3_ranks(zero_saved: tuple[str, list[float]],
                                                            via: str) -> None:
    from safetensors.torch import load_file

    from shardckpt.checkpoint.reader import CheckpointReader

    root, theirs = zero_saved
    out = run_distributed(fsdp2_from_flat_job, 3, args=(root, via), timeout_s=300)[0]
    m = CheckpointReader(f"{root}/zero").manifest
    got = load_file(f"{root}/fsdp2-loaded-{via}.safetensors")
    comp = m.components["model"]
    for p in comp.layout.params:
        for kind, key in (("master", f"model.{p.fqn}"), ("exp_avg", f"optim.{p.fqn}.exp_avg"),
                          ("exp_avg_sq", f"optim.{p.fqn}.exp_avg_sq")):
            want = flat_state(f"{root}/zero", p.fqn, kind)
            assert torch.equal(got[key].view(torch.int32), want.view(torch.int32)), (p.fqn, kind)
        assert float(got[f"optim.{p.fqn}.step"]) == LLAMA_STEPS
    assert [(g["params"], g["weight_decay"], g["lr"], g["betas"]) for g in out["groups"]] == \
        [(g["params"], g["hparams"]["weight_decay"], g["hparams"]["lr"], g["hparams"]["betas"])
         for g in m.optimizer.param_groups]
    assert out["losses"] == pytest.approx(theirs, rel=1e-6), (out["losses"], theirs)
