"""Stages, mixed precision, accumulation, tied units, full parameters and activation
checkpointing in one process (no torch.distributed): configuration errors and local behaviour.

Multi-rank parity lives in ``integration/test_runtime_stages.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardckpt.errors import ConfigError
from shardckpt.runtime import (
    MixedPrecisionPolicy,
    ShardedAdamW,
    ZeroEngine,
    checkpoint_units,
    units_by_type,
)
from shardckpt.runtime import flat as flat_module
from shardckpt.runtime.models.llama import (
    LLAMA_POLICY,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaEmbedding,
    LlamaForCausalLM,
    causal_lm_loss,
)
from shardckpt.runtime.mesh import ProcessMesh

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)


pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(seed: int = 0, **kwargs) -> ZeroEngine:
    torch.manual_seed(seed)
    kwargs.setdefault("policy", LLAMA_POLICY)
    return ZeroEngine(LlamaForCausalLM(CFG), process_mesh=ProcessMesh.single(),
                      deterministic=True, **kwargs)


def _tokens(step: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))


def _step(engine: ZeroEngine, opt: torch.optim.Optimizer, step: int = 0) -> None:
    tokens = _tokens(step)
    causal_lm_loss(engine(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def gathers(monkeypatch) -> list[int]:
    """Numels of the flat groups all-gathered (a gather that finds the group gathered is free)."""
    seen: list[int] = []
    real = flat_module.collectives.all_gather_shard

    def counting(pm, full, shard, **kwargs):  # kwargs: async_op (prefetch), acct
        seen.append(full.numel())
        return real(pm, full, shard, **kwargs)

    monkeypatch.setattr(flat_module.collectives, "all_gather_shard", counting)
    return seen


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("stage", [0, 4, True, "3"])
def test_an_unknown_stage_is_refused(stage):
    with pytest.raises(ConfigError, match="stage is"):
        _engine(stage=stage)


def test_mixed_precision_policy_is_validated():
    with pytest.raises(ConfigError, match="param_dtype=torch.int8"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(ConfigError, match="reduce_dtype='bf16'"):
        MixedPrecisionPolicy(reduce_dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="MixedPrecisionPolicy"):
        _engine(mixed_precision=torch.bfloat16)


def test_policy_that_splits_tied_parameters_names_both():
    with pytest.raises(ConfigError) as err:
        _engine(policy=units_by_type(LlamaDecoderLayer, LlamaEmbedding))
    assert "lm_head.weight" in str(err.value) and "model.embed_tokens.weight" in str(err.value)


def test_stage_and_precision_do_not_change_the_stored_state():
    def signature(engine: ZeroEngine) -> dict:
        ShardedAdamW(engine)
        return {(g, k): (t.shape, t.dtype) for g, kinds in engine.local_shards().items()
                for k, t in kinds.items()}

    base = _engine()
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)
    for kwargs in (dict(stage=1), dict(stage=2), dict(stage=3, mixed_precision=mp)):
        other = _engine(**kwargs)
        assert other.layout == base.layout and other.tied_aliases == base.tied_aliases
        assert signature(other) == signature(_engine())
        assert all(torch.equal(other.local_shards()[n]["master"], k["master"])
                   for n, k in base.local_shards().items())


# ---------------------------------------------------------------------------------- stages


def test_stage_3_frees_and_stages_1_2_keep_parameters(gathers):
    layer_numel = next(g.spec.padded_numel for g in _engine().groups.values() if g.spec.unit)
    for stage, gathered_after, per_step in ((3, False, 5), (2, True, 3), (1, True, 3)):
        engine = _engine(stage=stage)
        opt = ShardedAdamW(engine, lr=1e-2)
        gathers.clear()
        _step(engine, opt, 0)
        tokens = _tokens(1)
        causal_lm_loss(engine(tokens), tokens).backward()
        assert all(g.gathered for g in engine.groups.values()) is gathered_after  # until step
        opt.step()
        opt.zero_grad()
        assert all(g.gathered for g in engine.groups.values()) is gathered_after
        held = engine.module.model.layers[0].mlp.up_proj.weight
        assert (held.numel() > 0) is gathered_after
        # stage 3: root once, each layer for forward and backward; 1 and 2: each unit once (the
        # first forward, then after each step; the second forward gathers nothing).
        expected = 2 * per_step if stage == 3 else 3 + 2 * 3
        assert len(gathers) == expected, (stage, gathers)
        assert gathers.count(layer_numel) == (8 if stage == 3 else 6)


def test_stage_1_keeps_a_whole_gradient_buffer_and_reduces_like_stage_2():
    """Stage 1 reduce-scatters like stage 2 (the same shard bits) but keeps the whole local
    gradient buffer resident: allocated once, reused by every backward, the shard a view of its
    own slice; stage 2 frees its buffer once reduced."""
    one, two = _engine(stage=1), _engine(stage=2)
    opts = {id(e): ShardedAdamW(e, lr=1e-2) for e in (one, two)}
    buffers = {}

    def backward(engine, step, sync=True):
        tokens = _tokens(step)
        with (contextlib.nullcontext() if sync else engine.no_sync()):
            causal_lm_loss(engine(tokens), tokens).backward()

    def check(where):
        for name, g in one.groups.items():
            other = two.groups[name]
            buf = g.grad_buffer
            assert buf is not None and buf.numel() == g.spec.padded_numel, where
            assert buf.dtype == torch.float32 and g.local_grad is None, where
            assert buffers.setdefault(name, buf.data_ptr()) == buf.data_ptr(), where  # reused
            view = buf[g.shard_start:g.shard_end]
            assert g.grad.data_ptr() == view.data_ptr() and g.grad.shape == view.shape, where
            assert torch.equal(g.grad, other.grad), (where, name)
            assert other.grad_buffer is None and other.local_grad is None, where
        kinds = one.model_state_bytes()
        assert kinds["grads"] == sum(g.grad_buffer.untyped_storage().nbytes()
                                     for g in one.groups.values()), where

    for engine in (one, two):
        backward(engine, 0)
    check("one backward")
    for engine in (one, two):  # a second synced backward adds its mean
        backward(engine, 1)
    check("two synced backward passes")
    for engine in (one, two):
        opts[id(engine)].step()
        opts[id(engine)].zero_grad()
    for name, g in one.groups.items():
        assert g.grad is None and g.grad_buffer.data_ptr() == buffers[name]  # still resident
        assert torch.equal(g.master, two.groups[name].master)
    for engine in (one, two):  # accumulation without sync, then a synced backward
        backward(engine, 2, sync=False)
        backward(engine, 3)
    check("no_sync, then synced")
    one.zero_grad(set_to_none=False)
    assert all(g.grad is not None and not g.grad.any() and not g.grad_buffer[
        g.shard_start:g.shard_end].any() for g in one.groups.values())
    for engine in (one, two):
        engine.zero_grad(set_to_none=False)
        backward(engine, 4)
    check("after zero_grad(set_to_none=False)")


def test_stage_1_with_a_bf16_gradient_keeps_the_fp32_shard_apart():
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)
    one, two = _engine(stage=1, mixed_precision=policy), _engine(stage=2, mixed_precision=policy)
    tokens = _tokens()
    for engine in (one, two):
        causal_lm_loss(engine(tokens), tokens).backward()
    for name, g in one.groups.items():
        assert g.grad_buffer.dtype == torch.bfloat16 and g.grad.dtype == torch.float32
        assert g.grad.untyped_storage().data_ptr() != g.grad_buffer.untyped_storage().data_ptr()
        assert torch.equal(g.grad, two.groups[name].grad)


# ---------------------------------------------------------------------- mixed precision


def test_bf16_policy_computes_in_bf16_with_fp32_masters():
    engine = _engine(mixed_precision=MixedPrecisionPolicy())
    seen = {}

    def probe(module, args):
        seen["dtype"] = module.weight.dtype

    engine.module.model.layers[0].mlp.up_proj.register_forward_pre_hook(probe)
    opt = ShardedAdamW(engine, lr=1e-2)
    before = {n: k["master"].clone() for n, k in engine.local_shards().items()}
    _step(engine, opt)
    assert seen["dtype"] == torch.bfloat16
    for name, g in engine.groups.items():
        assert g.master.dtype == torch.float32 and g.grad is None
        assert not torch.equal(g.master, before[name])  # fp32 masters moved
        assert torch.equal(g.compute, g.master.bfloat16())  # compute re-derived, RNE


# ----------------------------------------------------------------- gradient accumulation


def test_no_sync_reduces_nothing_until_the_last_micro_batch():
    engine = _engine()
    opt = ShardedAdamW(engine)
    with engine.no_sync():
        for m in range(2):
            tokens = _tokens(m)
            causal_lm_loss(engine(tokens), tokens).backward()
    assert all(g.grad is None and g.has_pending_grad for g in engine.groups.values())
    with pytest.raises(ConfigError, match="no_sync"):
        opt.step()
    with pytest.raises(ConfigError, match="no_sync"):
        engine.clip_grad_norm_(1.0)
    tokens = _tokens(2)
    causal_lm_loss(engine(tokens), tokens).backward()
    assert all(g.grad is not None and not g.has_pending_grad for g in engine.groups.values())
    # Reductions issued asynchronously during backward are all finished by its end, and the
    # pool of released gradient buffers holds nothing between steps.
    assert not any(g.reducing for g in engine.groups.values())
    assert not engine._schedule.pool._free
    opt.step()


# -------------------------------------------------------------------- full parameters


def test_summon_full_params_reads_and_writes_back():
    torch.manual_seed(0)
    eager = LlamaForCausalLM(CFG)
    for stage in (3, 1):
        engine = _engine(stage=stage)
        with engine.summon_full_params() as full:
            assert torch.equal(full["lm_head.weight"], eager.lm_head.weight)
            assert engine.module.lm_head.weight is full["model.embed_tokens.weight"]
            with torch.no_grad():
                full["model.norm.weight"].zero_()  # discarded: no writeback
        assert torch.equal(engine.gather_full_params()["model.norm.weight"], eager.model.norm.weight)
        assert engine.module.model.norm.weight.numel() == 0  # placeholders again
        with engine.summon_full_params(writeback=True) as full, torch.no_grad():
            full["model.norm.weight"].fill_(2.0)
        assert torch.equal(engine.gather_full_params()["model.norm.weight"], torch.full((16,), 2.0))
        gathered = engine.module.model.norm.weight
        assert (gathered.numel() == 16) is (stage == 1)  # stage 1 re-gathered the new values
        if stage == 1:
            assert torch.equal(gathered, torch.full((16,), 2.0))


def test_summon_full_params_is_refused_inside_forward():
    engine = _engine()

    def inside(module, args):
        with engine.summon_full_params():
            pass

    engine.module.model.layers[0].register_forward_pre_hook(inside)
    with pytest.raises(ConfigError, match="inside forward or backward"):
        engine(_tokens())


def test_full_state_dict_round_trip_and_errors():
    torch.manual_seed(0)
    eager = LlamaForCausalLM(CFG)
    engine = _engine(seed=1)
    sd = engine.full_state_dict(dtype=torch.bfloat16)
    assert list(sd) == list(eager.state_dict())
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    engine.load_full_state_dict(eager.state_dict())
    assert all(torch.equal(engine.full_state_dict()[k], v) for k, v in eager.state_dict().items())
    with torch.no_grad():
        assert torch.equal(engine(_tokens()), eager(_tokens()))
    bad = {k: v for k, v in eager.state_dict().items() if k != "model.norm.weight"}
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    bad["extra"] = torch.zeros(1)
    with pytest.raises(ConfigError) as err:
        engine.load_full_state_dict(bad)
    assert all(s in str(err.value) for s in ("model.norm.weight", "extra", "up_proj", "[3, 3]"))


# -------------------------------------------------------------- activation checkpointing


def test_checkpointed_units_recompute_with_gathered_weights(gathers):
    plain, ckpt = _engine(), _engine()
    assert checkpoint_units(ckpt) == ["model.layers.0", "model.layers.1"]
    layer = ckpt.module.model.layers[1]
    group = next(g for g in ckpt.groups.values() if g.spec.unit == "model.layers.1")
    calls = []

    def probe(module, args):  # inside the unit: runs in forward and in the recomputation
        calls.append((torch._C._current_graph_task_id() != -1,
                      all(p.numel() > 0 for p in group.params)))

    layer.mlp.register_forward_pre_hook(probe)
    counts = []
    for engine in (plain, ckpt):
        opt = ShardedAdamW(engine, lr=1e-2)
        gathers.clear()
        tokens = _tokens()
        loss = causal_lm_loss(engine(tokens), tokens)
        if engine is ckpt:
            assert not group.gathered and calls == [(False, True)]  # freed after forward
        loss.backward()
        counts.append(len(gathers))
        opt.step()
    assert calls == [(False, True), (True, True)]  # recomputed in backward, weights gathered
    assert counts[0] == counts[1]  # no extra all-gathers
    full = plain.gather_full_params()
    assert all(torch.equal(t, full[n]) for n, t in ckpt.gather_full_params().items())


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _UserCheckpointed(nn.Module):
    """Calls ``torch.utils.checkpoint`` on a unit from its own forward (hooks inside)."""

    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)  # the root's: the unit's input needs a gradient, so the
        self.a, self.b = _Block(), _Block()  # unit's backward reads its weights
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.use_checkpoint:
            # early_stop=False: the recomputation runs the unit's forward hook too
            x = checkpoint(self.a, x, use_reentrant=False, early_stop=False)
        else:
            x = self.a(x)
        return self.b(x)


@pytest.mark.parametrize("stage", [3, 2])
def test_user_checkpoint_of_a_unit_call_works(stage):
    results = []
    for use in (False, True):
        torch.manual_seed(0)
        engine = ZeroEngine(_UserCheckpointed(use), policy=_Block, stage=stage,
                            process_mesh=ProcessMesh.single(), deterministic=True)
        opt = ShardedAdamW(engine, lr=1e-2)
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            F.mse_loss(engine(x), torch.zeros(4, 8)).backward()
            opt.step()
            opt.zero_grad()
        results.append(engine.gather_full_params())
        assert (not any(g.gathered for g in engine.groups.values())) is (stage == 3)
    assert all(torch.equal(results[0][n], t) for n, t in results[1].items())


def test_bf16_policy_casts_float_inputs_and_keeps_frozen_groups():
    torch.manual_seed(0)
    model = _UserCheckpointed(use_checkpoint=True)
    model.a.fc.requires_grad_(False)
    before = model.a.fc.weight.detach().clone()
    engine = ZeroEngine(model, policy=_Block, process_mesh=ProcessMesh.single(),
                        mixed_precision=MixedPrecisionPolicy())
    opt = ShardedAdamW(engine, lr=1e-2)
    for _ in range(2):
        out = engine(torch.randn(4, 8))  # fp32 input, cast to bf16 by the root unit
        assert out.dtype == torch.bfloat16
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    frozen = [g for g in engine.groups.values() if not g.trainable]
    assert len(frozen) == 1 and frozen[0].master.dtype == torch.float32
    assert frozen[0].compute.dtype == torch.bfloat16
    assert torch.equal(engine.gather_full_params(["a.fc.weight"])["a.fc.weight"], before)
    assert set(engine.local_shards()[frozen[0].name]) == {"master"}
