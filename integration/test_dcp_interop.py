"""One checkpoint across runtimes, under real FSDP2 on gloo.

* A checkpoint DCP's own ``FileSystemWriter`` wrote from 2 ranks is imported (``shardckpt import
  dcp``) and loads through :class:`shardckpt.interop.dcp.storage.ShardckptReader` into 3 ranks; exported back
  (``shardckpt export dcp``), stock ``dcp.load`` + ``set_state_dict`` read it into 1, 2 and 3.
* FSDP2 (stock DCP, 2 ranks) -> ``import dcp --ranks 3`` -> ``ZeroEngine`` on 3 ranks.
* ``ZeroEngine`` (2 ranks) -> FSDP2 on 3 ranks, through ``ShardckptReader`` (no conversion) and
  through its DCP export with stock ``dcp.load``.
* The other way round: ``ZeroEngine`` at 3 ranks -> FSDP2 at 2, FSDP2 at 3 -> ``ZeroEngine`` at 2;
  HSDP both ways: FSDP2 on a (2, 2) mesh <-> ``ZeroEngine`` with replicate 2 at 4 ranks.
* FSDP2 with frozen parameters -> ``import dcp --ranks 2 --frozen`` (and as chunks) ->
  ``ZeroEngine`` with the same parameters frozen; a step leaves them unchanged.

Weights and Adam moments bit for bit, param groups equal, and training continues: global mean
losses of the next steps equal the source runtime's own continuation to the relative 1e-6 the
ZeroEngine/FSDP2 comparison (test_runtime_fsdp2.py) states for fp32.

The first model, optimizer and state layout are those of integration/test_dcp_fsdp2.py; the
Llama jobs are in testing/dcp_llama.py. Each launch serves several directions (one job loads what
earlier ones saved at another world size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from testing.ckpts import flat_state
from testing.dcp_llama import (
    FROZEN, LLAMA_STEPS, engine_job, engine_save_job, fsdp2_from_flat_job, fsdp2_llama_job,
    hsdp_job, two_ranks_job,
)
from testing.fsdp2_dcp import (
    STEPS, build, compare_with_reference, full_state, load_job, state, tp_tensor, train_step,
)
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


def three_ranks_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """The import through ShardckptReader, then the export with stock ``dcp.load``."""
    return {"reader": load_job(rank, world, f"{root}/ck", root),
            "stock": stock_load_job(rank, world, f"{root}/exported", root)}


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """A stock DCP checkpoint from 2 FSDP2 ranks, imported, and exported back."""
    from shardckpt.interop.dcp.export import export_dcp
    from shardckpt.interop.dcp.import_ import import_dcp

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
    for r in run_distributed(three_ranks_job, 3, args=(root,), timeout_s=300):
        assert r["reader"]["differ"] == [] and r["reader"]["groups"], r
        assert r["stock"]["differ"] == [] and r["stock"]["groups"], r


@pytest.mark.parametrize("world", [1, 2])  # 3: in the job of the test above
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


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def assert_engine_state_is_reference(root: str, ckpt: str, name: str = "llama") -> None:
    """Masters (frozen ones too), moments and param groups of ZeroEngine checkpoint ``ckpt`` are
    FSDP2's saved state ``root/<name>-reference``."""
    from safetensors.torch import load_file

    from shardckpt.checkpoint.reader import CheckpointReader

    m = CheckpointReader(ckpt).manifest
    comp = m.components["model"]
    want = load_file(f"{root}/{name}-reference.safetensors")
    for p in comp.layout.params:
        kinds = [k for k, _ in comp.states[p.group]]
        for kind in kinds:
            key = f"model.{p.fqn}" if kind == "master" else f"optim.{p.fqn}.{kind}"
            assert same_bits(flat_state(ckpt, p.fqn, kind), want[key]), (p.fqn, kind)
    want_groups = json.loads(Path(root, f"{name}-reference.json").read_text())
    assert m.optimizer is not None and m.optimizer.name == "adamw"
    assert [(sorted(g["params"]), g["hparams"]["weight_decay"], g["hparams"]["lr"], g["step"])
            for g in m.optimizer.param_groups] == \
        [(sorted(w["params"]), w["weight_decay"], w["lr"], LLAMA_STEPS) for w in want_groups]


def assert_fsdp2_state_is_engine(got_file: str, ckpt: str) -> None:
    """What FSDP2 gathered after loading (``got_file``) is ZeroEngine checkpoint ``ckpt``."""
    from safetensors.torch import load_file

    from shardckpt.checkpoint.reader import CheckpointReader

    got = load_file(got_file)
    for p in CheckpointReader(ckpt).manifest.components["model"].layout.params:
        for kind, key in (("master", f"model.{p.fqn}"), ("exp_avg", f"optim.{p.fqn}.exp_avg"),
                          ("exp_avg_sq", f"optim.{p.fqn}.exp_avg_sq")):
            assert same_bits(got[key], flat_state(ckpt, p.fqn, kind)), (p.fqn, kind)
        assert float(got[f"optim.{p.fqn}.step"]) == LLAMA_STEPS


def assert_same_engine_state(a: str, b: str) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader

    comp = CheckpointReader(a).manifest.components["model"]
    for p in comp.layout.params:
        for kind, _ in comp.states[p.group]:
            assert same_bits(flat_state(a, p.fqn, kind), flat_state(b, p.fqn, kind)), (p.fqn, kind)


@pytest.fixture(scope="module")
def llama_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[float]]]:
    """FSDP2 on 2 ranks saved with stock DCP and through ShardckptWriter, without (``llama``)
    and with frozen parameters (``frozen``); their next losses."""
    root = str(tmp_path_factory.mktemp("llama"))
    return root, run_distributed(fsdp2_llama_job, 2, args=(root,), timeout_s=300)[0]


@pytest.fixture(scope="module")
def engine_from_fsdp2(llama_fsdp2: tuple[str, dict[str, list[float]]]) -> dict[str, list[float]]:
    """ZeroEngine on 3 ranks loads ``llama`` imported for 3 ranks (``flat``) and, without a
    conversion, ``llama-chunked``; saves each again (``...-resaved``); next losses by way."""
    from shardckpt.interop.dcp.to_flat import import_dcp_flat

    root, _ = llama_fsdp2
    m = import_dcp_flat(f"{root}/llama", f"{root}/flat", 3)
    comp = m.components["model"]
    assert comp.aliases == {"lm_head.weight": "model.embed_tokens.weight"} and not comp.buffers
    ckpts = [(f"{root}/flat", "flat"), (f"{root}/llama-chunked", "chunked")]
    return run_distributed(engine_job, 3, args=(ckpts,), timeout_s=300)[0]


def test_fsdp2_stock_checkpoint_imports_for_zero_engine_at_3_ranks(
        llama_fsdp2: tuple[str, dict[str, list[float]]],
        engine_from_fsdp2: dict[str, list[float]]) -> None:
    root, fsdp2 = llama_fsdp2
    assert_engine_state_is_reference(root, f"{root}/flat")
    assert_engine_state_is_reference(root, f"{root}/flat-resaved")
    ours = engine_from_fsdp2["flat"]
    assert ours == pytest.approx(fsdp2["llama"], rel=1e-6), (ours, fsdp2)


def test_zero_engine_loads_fsdp2_chunked_checkpoint_at_3_ranks(
        llama_fsdp2: tuple[str, dict[str, list[float]]],
        engine_from_fsdp2: dict[str, list[float]]) -> None:
    root, fsdp2 = llama_fsdp2
    assert_engine_state_is_reference(root, f"{root}/llama-chunked-resaved")
    ours = engine_from_fsdp2["chunked"]
    assert ours == pytest.approx(fsdp2["llama"], rel=1e-6), (ours, fsdp2)


# ------------------------------- ZeroEngine -> FSDP2 through ShardckptReader (no conversion step)


@pytest.fixture(scope="module")
def zero_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """A ZeroEngine checkpoint from 2 ranks, its DCP export, and the engine's next losses."""
    from shardckpt.interop.dcp.export import export_dcp

    root = str(tmp_path_factory.mktemp("zero"))
    theirs = run_distributed(engine_save_job, 2, args=(root,), timeout_s=300)[0]
    export_dcp(f"{root}/zero", f"{root}/zero-exported")
    return root, theirs


@pytest.fixture(scope="module")
def fsdp2_from_zero(zero_saved: tuple[str, list[float]]) -> dict[str, Any]:
    """FSDP2 on 3 ranks loads ``zero`` through ShardckptReader and saves it with stock DCP
    (``fsdp2-3``), then loads ``zero-exported`` with stock DCP; param groups and next losses."""
    root, _ = zero_saved
    return run_distributed(fsdp2_from_flat_job, 3, args=(root,), timeout_s=300)[0]


@pytest.mark.parametrize("via", ["reader", "export"])
def test_zero_engine_checkpoint_loads_into_fsdp2_at_3_ranks(
        zero_saved: tuple[str, list[float]], fsdp2_from_zero: dict[str, Any], via: str) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader

    root, theirs = zero_saved
    out = fsdp2_from_zero[via]
    m = CheckpointReader(f"{root}/zero").manifest
    assert_fsdp2_state_is_engine(f"{root}/fsdp2-loaded-{via}.safetensors", f"{root}/zero")
    assert [(g["params"], g["weight_decay"], g["lr"], g["betas"]) for g in out["groups"]] == \
        [(g["params"], g["hparams"]["weight_decay"], g["hparams"]["lr"], g["hparams"]["betas"])
         for g in m.optimizer.param_groups]
    assert out["losses"] == pytest.approx(theirs, rel=1e-6), (out["losses"], theirs)


# ---------------------------- 3 -> 2 both ways and frozen parameters (one 2-rank launch), HSDP


def test_three_to_two_ranks_both_ways_and_frozen_parameters(
        llama_fsdp2: tuple[str, dict[str, list[float]]], engine_from_fsdp2: dict[str, list[float]],
        zero_saved: tuple[str, list[float]], fsdp2_from_zero: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    from shardckpt.interop.dcp.to_flat import import_dcp_flat

    root, fsdp2 = llama_fsdp2
    zroot, _ = zero_saved
    import_dcp_flat(f"{zroot}/fsdp2-3", f"{zroot}/fsdp2-3-flat", 2)
    m = import_dcp_flat(f"{root}/frozen", f"{root}/frozen-flat", 2, frozen=[FROZEN])
    frozen = sorted(f for g in m.components["model"].layout.groups if not g.requires_grad
                    for f in g.params)
    assert len(frozen) == 3 and not m.components["model"].buffers, frozen
    out = run_distributed(two_ranks_job, 2, args=(root, zroot), timeout_s=300)[0]
    # ZeroEngine at 3 -> FSDP2 at 2
    assert_fsdp2_state_is_engine(f"{root}/fsdp2-2-loaded.safetensors", f"{root}/flat-resaved")
    assert out["fsdp2"] == pytest.approx(engine_from_fsdp2["flat"], rel=1e-6)
    # FSDP2 at 3 -> ZeroEngine at 2
    assert_engine_state_is_reference(zroot, f"{zroot}/fsdp2-3-flat-resaved", "fsdp2-3")
    assert out["zero"] == pytest.approx(fsdp2_from_zero["reader"]["losses"], rel=1e-6)
    # frozen parameters: loaded bit for bit, through the import and as chunks; unchanged by steps
    want = load_file(f"{root}/frozen-reference.safetensors")
    for ckpt in ("frozen-flat", "frozen-chunked"):
        assert_engine_state_is_reference(root, f"{root}/{ckpt}-resaved", "frozen")
        assert out[ckpt.replace("-flat", "")] == pytest.approx(fsdp2["frozen"], rel=1e-6)
        for f in frozen:
            assert same_bits(flat_state(f"{root}/{ckpt}-after", f, "master"), want[f"model.{f}"])


def test_hsdp_2x2_fsdp2_and_zero_engine_replicate_2_both_ways(
        zero_saved: tuple[str, list[float]]) -> None:
    root, _ = zero_saved
    out = run_distributed(hsdp_job, 4, args=(root,), timeout_s=300)[0]
    assert_same_engine_state(f"{root}/zero", f"{root}/zero-hsdp")
    # ZeroEngine replicate 2 -> FSDP2 (2, 2)
    assert_fsdp2_state_is_engine(f"{root}/fsdp2-hsdp.safetensors", f"{root}/zero-hsdp")
    assert out["fsdp2"] == pytest.approx(out["zero"], rel=1e-6)
    # FSDP2 (2, 2) -> ZeroEngine replicate 2
    assert_engine_state_is_reference(root, f"{root}/fsdp2-hsdp-chunked-resaved", "fsdp2-hsdp")
    assert_same_engine_state(f"{root}/zero", f"{root}/fsdp2-hsdp-chunked-resaved")
    assert out["zero-again"] == pytest.approx(out["fsdp2"], rel=1e-6)
