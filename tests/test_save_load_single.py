"""Save/load on one process: strict and non-strict loading, weights-only, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardckpt.errors import CollectiveError, IncompatibleLayoutError
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.training.save_load import load, save


class Net(nn.Module):
    def __init__(self, extra: bool = False, wide: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 12 if wide else 8)
        self.b = nn.Linear(12 if wide else 8, 4)
        if extra:
            self.c = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return self.c(h) if hasattr(self, "c") else h


def engine_for(net: nn.Module, with_opt: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    for p in net.parameters():
        nn.init.normal_(p)
    engine = ZeroEngine(net, policy=(nn.Linear,))
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2) if with_opt else None
    return engine, opt


def step(engine, opt) -> None:
    engine(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_round_trip_single_process(tmp_path):
    engine, opt = engine_for(Net())
    step(engine, opt)
    engine.buffers()["scale"].fill_(7.0)
    m = save(engine, str(tmp_path / "ck"))
    assert m.mesh.world_size == 1
    other, oopt = engine_for(Net(), seed=1)
    load(other, str(tmp_path / "ck"))
    for g, kinds in engine.local_shards().items():
        for kind, t in kinds.items():
            assert torch.equal(other.local_shards()[g][kind], t), (g, kind)
    assert torch.equal(other.buffers()["scale"], torch.full((3,), 7.0))
    assert [g["step"] for g in oopt.optimizer_metadata()["param_groups"]] == [1, 1]


def test_strict_lists_every_difference(tmp_path):
    engine, opt = engine_for(Net())
    save(engine, str(tmp_path / "ck"))
    wide, _ = engine_for(Net(extra=True, wide=True))
    with pytest.raises(CollectiveError) as ei:
        load(wide, str(tmp_path / "ck"))
    msg = str(ei.value)
    assert "c.weight" in msg and "c.bias" in msg and "a.weight" in msg and "b.weight" in msg
    assert isinstance(ei.value.__cause__, IncompatibleLayoutError)


def test_non_strict_loads_what_matches(tmp_path):
    engine, opt = engine_for(Net())
    step(engine, opt)
    save(engine, str(tmp_path / "ck"))
    bigger, bopt = engine_for(Net(extra=True), seed=5)
    before = bigger.gather_full_params(["c.weight"])["c.weight"].clone()
    res = load(bigger, str(tmp_path / "ck"), strict=False)
    assert res.missing == ("c.weight", "c.bias") and res.unexpected == () and res.mismatched == ()
    full = bigger.gather_full_params()
    ref = engine.gather_full_params()
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        assert torch.equal(full[name], ref[name])
    assert torch.equal(full["c.weight"], before)


def test_weights_only(tmp_path):
    plain, _ = engine_for(Net(), with_opt=False)
    save(plain, str(tmp_path / "w"))
    engine, opt = engine_for(Net(), seed=3)
    step(engine, opt)
    load(engine, str(tmp_path / "w"), weights_only=True)
    full, ref = engine.gather_full_params(), plain.gather_full_params()
    assert all(torch.equal(full[k], ref[k]) for k in ref)
    assert [g["step"] for g in opt.optimizer_metadata()["param_groups"]] == [1, 1]  # left alone


def test_a_checkpoint_without_optimizer_state_starts_the_optimizer_fresh(tmp_path, caplog):
    plain, _ = engine_for(Net(), with_opt=False)
    save(plain, str(tmp_path / "w"))
    engine, opt = engine_for(Net(), seed=3)
    step(engine, opt)
    with caplog.at_level("WARNING", logger="shardckpt.training.save_load"):
        load(engine, str(tmp_path / "w"))
    assert "optimizer starts fresh" in caplog.text
    full, ref = engine.gather_full_params(), plain.gather_full_params()
    assert all(torch.equal(full[k], ref[k]) for k in ref)
    assert [g["step"] for g in opt.optimizer_metadata()["param_groups"]] == [0, 0]
    assert all(not t.any() for kinds in engine.local_shards().values()
               for k, t in kinds.items() if k != "master")


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    """State of another optimizer is not "no optimizer state": the load is refused, not reset."""
    from shardckpt.runtime import ShardedSGD

    torch.manual_seed(0)
    engine = ZeroEngine(Net(), policy=(nn.Linear,))
    sgd = ShardedSGD(engine, lr=1e-2, momentum=0.9)
    step(engine, sgd)
    save(engine, str(tmp_path / "sgd"))
    other, _ = engine_for(Net(), seed=3)
    with pytest.raises(CollectiveError, match="no exp_avg.*weights_only=True"):
        load(other, str(tmp_path / "sgd"))


def test_missing_checkpoint_is_one_clear_error(tmp_path):
    engine, _ = engine_for(Net())
    with pytest.raises(CollectiveError, match="no such checkpoint"):
        load(engine, str(tmp_path / "nothing"))
