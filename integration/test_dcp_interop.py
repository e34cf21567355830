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
Llama jobs are in testing/dcp_llama.py. The launches are shared with test_dcp_fsdp2.py
(testing/dcp_runs.py: one launch per world size and stage, several scenarios run one after another
in it, one stage loading what an earlier one saved at another world size); each test asserts on
its scenarios' results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from testing.ckpts import flat_state
from testing.dcp_llama import LLAMA_STEPS
from testing.dcp_runs import Runs, shared_runs

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return shared_runs(request, tmp_path_factory)


def test_imported_stock_checkpoint_loads_through_shardckpt_reader(runs: Runs) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.checkpoint.verify import verify

    runs.ran("stock-save")  # saved from 2 FSDP2 ranks with stock DCP, imported, exported back
    root = runs.dir("interop")
    m = CheckpointReader(f"{root}/ck").manifest
    assert m.chunked is not None and len(m.files) == 2 and verify(f"{root}/ck")
    assert [(c.offsets, c.sizes) for c in m.chunked.tensors["tp.w"].chunks] == \
        [((0, 0), (5, 4)), ((0, 4), (5, 3))]
    for r in runs["three"]:
        assert r["reader"]["differ"] == [] and r["reader"]["groups"], r
        assert r["stock"]["differ"] == [] and r["stock"]["groups"], r


@pytest.mark.parametrize("world", [1, 2])  # 3: in the job of the test above
def test_exported_checkpoint_loads_with_stock_dcp(runs: Runs, world: int) -> None:
    next_losses = [r["next_loss"] for r in runs["stock-save"]]
    root = runs.dir("interop")
    assert sorted(p.name for p in Path(root, "exported").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    out = runs[f"stock-load-{world}"]
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


def llama_fsdp2(runs: Runs) -> tuple[str, dict[str, list[float]]]:
    """FSDP2 on 2 ranks saved with stock DCP and through ShardckptWriter, without (``llama``)
    and with frozen parameters (``frozen``); their next losses."""
    return runs.dir("llama"), runs["llama"][0]


def engine_from_fsdp2(runs: Runs) -> dict[str, list[float]]:
    """ZeroEngine on 3 ranks loads ``llama`` imported for 3 ranks (``flat``) and, without a
    conversion, ``llama-chunked``; saves each again (``...-resaved``); next losses by way."""
    out = runs["engine"][0]
    comp = runs.host["flat"].components["model"]  # what the import for 3 ranks returned
    assert comp.aliases == {"lm_head.weight": "model.embed_tokens.weight"} and not comp.buffers
    return out


def test_fsdp2_stock_checkpoint_imports_for_zero_engine_at_3_ranks(runs: Runs) -> None:
    root, fsdp2 = llama_fsdp2(runs)
    ours = engine_from_fsdp2(runs)["flat"]
    assert_engine_state_is_reference(root, f"{root}/flat")
    assert_engine_state_is_reference(root, f"{root}/flat-resaved")
    assert ours == pytest.approx(fsdp2["llama"], rel=1e-6), (ours, fsdp2)


def test_zero_engine_loads_fsdp2_chunked_checkpoint_at_3_ranks(runs: Runs) -> None:
    root, fsdp2 = llama_fsdp2(runs)
    ours = engine_from_fsdp2(runs)["chunked"]
    assert_engine_state_is_reference(root, f"{root}/llama-chunked-resaved")
    assert ours == pytest.approx(fsdp2["llama"], rel=1e-6), (ours, fsdp2)


# ------------------------------- ZeroEngine -> FSDP2 through ShardckptReader (no conversion step)


def zero_saved(runs: Runs) -> tuple[str, list[float]]:
    """A ZeroEngine checkpoint from 2 ranks, its DCP export, and the engine's next losses."""
    return runs.dir("zero"), runs["zero-save"][0]


def fsdp2_from_zero(runs: Runs) -> dict[str, Any]:
    """FSDP2 on 3 ranks loads ``zero`` through ShardckptReader and saves it with stock DCP
    (``fsdp2-3``), then loads ``zero-exported`` with stock DCP; param groups and next losses."""
    return runs["fsdp2-from-zero"][0]


@pytest.mark.parametrize("via", ["reader", "export"])
def test_zero_engine_checkpoint_loads_into_fsdp2_at_3_ranks(runs: Runs, via: str) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader

    root, theirs = zero_saved(runs)
    out = fsdp2_from_zero(runs)[via]
    m = CheckpointReader(f"{root}/zero").manifest
    assert_fsdp2_state_is_engine(f"{root}/fsdp2-loaded-{via}.safetensors", f"{root}/zero")
    assert [(g["params"], g["weight_decay"], g["lr"], g["betas"]) for g in out["groups"]] == \
        [(g["params"], g["hparams"]["weight_decay"], g["hparams"]["lr"], g["hparams"]["betas"])
         for g in m.optimizer.param_groups]
    assert out["losses"] == pytest.approx(theirs, rel=1e-6), (out["losses"], theirs)


# ---------------------------- 3 -> 2 both ways and frozen parameters (one 2-rank launch), HSDP


def test_three_to_two_ranks_both_ways_and_frozen_parameters(runs: Runs) -> None:
    """After the 3-rank launch, FSDP2's 3-rank save was imported for 2 ranks
    (``fsdp2-3-flat``) and ``frozen`` imported with FROZEN frozen (``frozen-flat``)."""
    from safetensors.torch import load_file

    root, fsdp2 = llama_fsdp2(runs)
    zroot, _ = zero_saved(runs)
    from_fsdp2, from_zero = engine_from_fsdp2(runs), fsdp2_from_zero(runs)
    m = runs.host["frozen-flat"]  # what the import of ``frozen`` for 2 ranks returned
    frozen = sorted(f for g in m.components["model"].layout.groups if not g.requires_grad
                    for f in g.params)
    assert len(frozen) == 3 and not m.components["model"].buffers, frozen
    out = runs["two"][0]
    # ZeroEngine at 3 -> FSDP2 at 2
    assert_fsdp2_state_is_engine(f"{root}/fsdp2-2-loaded.safetensors", f"{root}/flat-resaved")
    assert out["fsdp2"] == pytest.approx(from_fsdp2["flat"], rel=1e-6)
    # FSDP2 at 3 -> ZeroEngine at 2
    assert_engine_state_is_reference(zroot, f"{zroot}/fsdp2-3-flat-resaved", "fsdp2-3")
    assert out["zero"] == pytest.approx(from_zero["reader"]["losses"], rel=1e-6)
    # frozen parameters: loaded bit for bit, through the import and as chunks; unchanged by steps
    want = load_file(f"{root}/frozen-reference.safetensors")
    for ckpt in ("frozen-flat", "frozen-chunked"):
        assert_engine_state_is_reference(root, f"{root}/{ckpt}-resaved", "frozen")
        assert out[ckpt.replace("-flat", "")] == pytest.approx(fsdp2["frozen"], rel=1e-6)
        for f in frozen:
            assert same_bits(flat_state(f"{root}/{ckpt}-after", f, "master"), want[f"model.{f}"])


def test_hsdp_2x2_fsdp2_and_zero_engine_replicate_2_both_ways(runs: Runs) -> None:
    root, _ = zero_saved(runs)
    out = runs["hsdp"][0]
    assert_same_engine_state(f"{root}/zero", f"{root}/zero-hsdp")
    # ZeroEngine replicate 2 -> FSDP2 (2, 2)
    assert_fsdp2_state_is_engine(f"{root}/fsdp2-hsdp.safetensors", f"{root}/zero-hsdp")
    assert out["fsdp2"] == pytest.approx(out["zero"], rel=1e-6)
    # FSDP2 (2, 2) -> ZeroEngine replicate 2
    assert_engine_state_is_reference(root, f"{root}/fsdp2-hsdp-chunked-resaved", "fsdp2-hsdp")
    assert_same_engine_state(f"{root}/zero", f"{root}/fsdp2-hsdp-chunked-resaved")
    assert out["zero-again"] == pytest.approx(out["fsdp2"], rel=1e-6)
