"""Prefetch order, ``reshard_after_forward=False`` and accounting in one process (no
torch.distributed). Multi-rank behaviour and independent measurements live in
``integration/test_runtime_prefetch.py`` and ``integration/test_runtime_accounting.py``.
"""

from __future__ import annotations

import pytest
import torch

from shardckpt.errors import ConfigError
from shardckpt.format.footprint_math import PRECISIONS
from shardckpt.runtime import MixedPrecisionPolicy, ShardedAdamW, ZeroEngine
from shardckpt.runtime.footprint import precision_preset_for
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.prefetch import Prefetcher

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=1)


class FakeUnit:
    def __init__(self, name: str) -> None:
        self.name, self.gathered, self.started = name, False, 0

    def start_gather(self) -> None:
        self.gathered, self.started = True, self.started + 1

    def __repr__(self) -> str:
        return self.name


def _forward(p: Prefetcher, units: list[FakeUnit]) -> None:
    p.begin_forward()
    for u in units:
        u.gathered = True
        p.pre_forward(u)
    for u in units[1:] + units[:1]:  # blocks finish first, the root (outermost) last
        p.post_forward(u)
        u.gathered = u is units[0]


def test_prefetcher_follows_the_last_forward_and_reverses_for_backward():
    root, a, b, c = units = [FakeUnit(n) for n in "rabc"]
    p = Prefetcher(True)
    _forward(p, units)
    assert [u.started for u in units] == [0, 0, 0, 0]  # nothing recorded yet: no prefetch
    for u in (root, c, b, a):  # backward, reverse order: each starts the next one to run
        p.pre_backward(u)
        p.pre_backward(u)  # several output gradients: one prefetch
        u.gathered = False
    assert [u.started for u in units] == [0, 1, 1, 1]  # c by root, b by c, a by b
    p.end_backward()
    _forward(p, units)  # second pass follows the first one's order
    assert [u.started for u in units] == [0, 2, 2, 2]
    assert p.prefetches == 6


def test_disabled_prefetcher_does_nothing():
    units = [FakeUnit(n) for n in "rab"]
    p = Prefetcher(False)
    for _ in range(2):
        _forward(p, units)
        for u in reversed(units):
            p.pre_backward(u)
        p.end_backward()
    assert p.prefetches == 0 and all(u.started == 0 for u in units)


def _engine(**kwargs) -> ZeroEngine:
    torch.manual_seed(0)
    return ZeroEngine(LlamaForCausalLM(CFG), policy=LLAMA_POLICY, process_mesh=ProcessMesh.single(),
                      deterministic=True, **kwargs)


def _train(engine: ZeroEngine, steps: int = 3) -> ShardedAdamW:
    opt = ShardedAdamW(engine, lr=1e-2)
    for i in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, 8),
                               generator=torch.Generator().manual_seed(i))
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("kwargs", [dict(prefetch=False), dict(reshard_after_forward=False),
                                    dict(reshard_root_after_forward=True)])
def test_options_give_the_same_bits(kwargs):
    base, other = _engine(), _engine(**kwargs)
    _train(base), _train(other)
    for name, kinds in base.local_shards().items():
        for kind, t in kinds.items():
            assert torch.equal(other.local_shards()[name][kind], t), (kwargs, name, kind)
    assert (other._schedule.prefetcher.prefetches > 0) is kwargs.get("prefetch", True)


def test_reshard_after_forward_false_keeps_units_until_their_backward():
    engine = _engine(reshard_after_forward=False)
    tokens = torch.randint(0, CFG.vocab_size, (2, 8))
    loss = causal_lm_loss(engine(tokens), tokens)
    assert all(g.gathered for g in engine.groups.values())
    peak = engine.accounting.peak_gathered_bytes
    assert peak == sum(g.spec.padded_numel * 4 for g in engine.groups.values())
    loss.backward()
    assert not any(g.gathered for g in engine.groups.values())
    assert engine.accounting.gathered_bytes == 0
    with torch.no_grad():  # no backward follows: nothing stays gathered
        engine(tokens)
    assert not any(g.gathered for g in engine.groups.values())


def test_prefetched_gathers_are_freed_by_a_forward_without_gradients():
    engine = _engine()
    _train(engine, 1)  # records the order
    with torch.no_grad():
        engine(torch.randint(0, CFG.vocab_size, (2, 8)))
    assert not any(g.gathered for g in engine.groups.values())
    assert engine._schedule.prefetcher.prefetches > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("policy", [None, MixedPrecisionPolicy(torch.bfloat16)])
def test_model_state_bytes_equal_the_estimate_on_one_rank(stage, policy):
    engine = _engine(stage=stage, mixed_precision=policy)
    opt = _train(engine, 1)
    tokens = torch.randint(0, CFG.vocab_size, (2, 8))
    causal_lm_loss(engine(tokens), tokens).backward()
    opt.step()
    kinds, est = engine.model_state_bytes(), engine.estimate()
    assert est.precision == ("fsdp2-bf16" if policy else "fsdp2-fp32")
    assert kinds == {k.kind: k.bytes for k in est.kinds}
    assert est.params == sum(g.padded_numel for g in engine.layout.groups)
    assert engine.accounting.comm_elements == 0  # one rank: nothing is sent


def test_no_preset_for_frozen_groups():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    model.model.norm.requires_grad_(False)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=ProcessMesh.single())
    with pytest.raises(ConfigError, match="no estimator preset"):
        precision_preset_for(engine.groups)
    assert engine.estimate(precision="fsdp2-fp32").precision == "fsdp2-fp32"


def test_fsdp2_fp32_preset_keeps_a_master_beside_replicated_params():
    p = PRECISIONS["fsdp2-fp32"]
    assert (p.params, p.grads, p.master, p.optim, p.transient_params) == (4, 4, 4, 8, True)
