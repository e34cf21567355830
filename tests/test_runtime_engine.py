"""ZeroEngine and the sharded optimizers in one process (no torch.distributed): the contract."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.format.layout import Mesh, ParamInfo, build_layout
from shardckpt.runtime import (
    ShardedAdamW,
    ShardedSGD,
    ZeroEngine,
    build_optimizer,
    decay_param_groups,
)
from shardckpt.runtime.flat import FlatParamGroup
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.mesh import ProcessMesh

CFG = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(seed: int = 0, **kwargs) -> ZeroEngine:
    torch.manual_seed(seed)
    return ZeroEngine(LlamaForCausalLM(CFG), policy=LLAMA_POLICY,
                      process_mesh=ProcessMesh.single(), deterministic=True, **kwargs)


def _tokens(step: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 10), generator=torch.Generator().manual_seed(step))


def _train(engine: ZeroEngine, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        tokens = _tokens(step)
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.unused = nn.Linear(d, d)  # never called: its gradient never arrives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Block()
        self.out = nn.Linear(8, 1)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("cache", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(self.a(x * self.scale)))


def test_layout_is_built_from_the_module_with_the_model_prefix():
    engine = _engine()
    infos = [ParamInfo(fqn, engine.layout.param(fqn).shape, "float32", True,
                       ".".join(fqn.split(".")[:3]) if ".layers." in fqn else "")
             for fqn, _ in engine.named_parameters()]
    assert engine.layout == build_layout(infos, Mesh.for_world(1), prefix="model.")
    assert engine.tied_aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    root = engine.layout.groups[0]
    assert root.unit == "" and root.params == ("model.embed_tokens.weight", "model.norm.weight")
    assert root.numel == max(g.numel for g in engine.layout.groups)  # vocab makes root largest
    for name, kinds in engine.local_shards().items():
        assert kinds["master"].numel() == engine.layout.shard_numel(name)


def test_params_are_views_into_the_gathered_buffer_only_while_their_unit_runs():
    engine = _engine()
    layer = engine.module.model.layers[1]
    group = next(g for g in engine.groups.values() if g.spec.unit == "model.layers.1")
    seen = {}

    def check(module, args, kwargs):
        base = group.full.untyped_storage().data_ptr()
        for p, spec in zip(group.params, group.param_specs):
            assert p.untyped_storage().data_ptr() == base
            assert p.storage_offset() == spec.offset and tuple(p.shape) == spec.shape
        seen["ok"] = True

    layer.register_forward_pre_hook(check, with_kwargs=True)
    tokens = _tokens()
    loss = causal_lm_loss(engine(tokens), tokens)
    assert seen["ok"]
    assert not group.gathered and all(p.numel() == 0 for p in group.params)  # freed after forward
    assert engine.groups[engine.layout.groups[0].name].gathered  # the root waits for backward
    loss.backward()
    assert not any(g.gathered for g in engine.groups.values())
    assert all(g.grad is not None for g in engine.groups.values())
    assert group.full.untyped_storage().nbytes() == 0
    with torch.no_grad():
        engine(tokens)
    assert not any(g.gathered for g in engine.groups.values())


def test_single_process_adamw_equals_torch_bit_for_bit():
    engine = _engine(seed=3)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    _train(engine, opt)
    torch.manual_seed(3)
    ref = LlamaForCausalLM(CFG)
    named = list(ref.named_parameters())
    ropt = torch.optim.AdamW([{"params": [p for n, p in named if p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}],
                             lr=1e-2, foreach=False)
    for step in range(3):
        tokens = _tokens(step)
        causal_lm_loss(ref(tokens), tokens).backward()
        for p in ref.parameters():
            p.grad = p.grad / 1
        ropt.step()
        ropt.zero_grad()
    full = engine.gather_full_params()
    assert all(torch.equal(full[n], p) for n, p in named)


def test_local_shards_are_the_live_storage():
    engine = _engine()
    opt = ShardedAdamW(engine)
    _train(engine, opt, steps=1)
    shards = engine.local_shards()
    assert set(next(iter(shards.values()))) == {"master", "exp_avg", "exp_avg_sq"}
    for name, kinds in shards.items():
        assert kinds["master"] is engine.groups[name].master
        assert kinds["exp_avg"].data_ptr() == opt.local_state(name)["exp_avg"].data_ptr()
        kinds["master"].zero_()
    engine.refresh_params()
    with torch.no_grad():
        assert engine(_tokens()).abs().max().item() == 0.0  # zero weights -> zero logits


def test_frozen_parameters_keep_their_values_and_have_no_state():
    torch.manual_seed(0)
    model = Small()
    model.a.fc.requires_grad_(False)
    before = model.a.fc.weight.detach().clone()
    engine = ZeroEngine(model, policy=Block, process_mesh=ProcessMesh.single())
    opt = ShardedSGD(engine, lr=0.1, momentum=0.9)
    for _ in range(2):
        engine(torch.randn(4, 8)).pow(2).mean().backward()  # Block.unused never gets a gradient
        opt.step()
        opt.zero_grad()
    frozen = [g for g in engine.layout.groups if not g.requires_grad]
    assert [g.name for g in frozen] == ["model.u0000.float32.frozen"]  # unit "a" comes first
    assert set(engine.local_shards()[frozen[0].name]) == {"master"}
    assert torch.equal(engine.gather_full_params(["a.fc.weight"])["a.fc.weight"], before)
    trained = engine.gather_full_params(["b.fc.weight"])["b.fc.weight"]
    assert not torch.equal(trained, Small().b.fc.weight)


def test_buffers_by_fqn_round_trip():
    engine = ZeroEngine(Small(), policy=Block, process_mesh=ProcessMesh.single())
    assert set(engine.buffers()) == {"scale"}  # the non-persistent one is left out
    x = torch.randn(2, 8)
    with torch.no_grad():
        y1 = engine(x)
        engine.load_buffers({"scale": torch.full((1,), 2.0)})
        y2 = engine(x)
    assert engine.buffers()["scale"].item() == 2.0 and not torch.equal(y1, y2)
    with pytest.raises(ConfigError, match="missing"):
        engine.load_buffers({})
    with pytest.raises(ConfigError, match="different shape"):
        engine.load_buffers({"scale": torch.ones(3)})


def test_optimizer_metadata_is_json_and_loads_back():
    engine = _engine()
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(engine, opt, steps=2)
    sched.step()
    meta = json.loads(json.dumps(opt.optimizer_metadata()))
    assert meta["name"] == "adamw" and meta["state_kinds"] == ["exp_avg", "exp_avg_sq"]
    decay, plain = meta["param_groups"]
    assert decay["step"] == 2 and decay["hparams"]["weight_decay"] == 0.1
    assert decay["hparams"]["betas"] == [0.8, 0.9] and decay["hparams"]["lr"] == 5e-3
    assert "model.norm.weight" in plain["params"] and "model.embed_tokens.weight" in decay["params"]

    other = _engine()
    opt2 = ShardedAdamW(other, decay_param_groups(other, 0.0), lr=1.0)
    opt2.load_optimizer_metadata(meta)
    assert opt2.optimizer_metadata() == meta
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9)
    with pytest.raises(ConfigError, match="do not match"):
        ShardedAdamW(_engine()).load_optimizer_metadata(meta)
    third = _engine()
    with pytest.raises(ConfigError, match="'adamw'"):
        ShardedSGD(third, decay_param_groups(third, 0.0)).load_optimizer_metadata(meta)


def test_whole_state_dict_is_refused():
    opt = ShardedAdamW(_engine())
    with pytest.raises(ShardckptError, match="Checkpointer"):
        opt.state_dict()
    with pytest.raises(ShardckptError):
        opt.load_state_dict({})


@pytest.mark.parametrize("name", ["Shampoo", "muon", "LAMB", "Adafactor"])
def test_whole_tensor_optimizers_are_refused(name):
    with pytest.raises(ConfigError, match="needs whole tensors"):
        build_optimizer(_engine(), name)


def test_build_optimizer_by_name_or_torch_class():
    assert isinstance(build_optimizer(_engine(), torch.optim.AdamW, lr=1e-3), ShardedAdamW)
    sgd = build_optimizer(_engine(), "sgd", lr=0.1, momentum=0.9)
    assert isinstance(sgd, ShardedSGD) and sgd.state_kinds == ("momentum_buffer",)
    with pytest.raises(ConfigError, match="unsupported optimizer"):
        build_optimizer(_engine(), "rmsprop")


def test_optimizer_params_must_belong_to_the_engine():
    with pytest.raises(ConfigError, match="not a parameter"):
        ShardedAdamW(_engine(), [nn.Parameter(torch.ones(2))])


def test_meta_init_is_unit_by_unit_and_equals_eager(monkeypatch):
    peak = {"now": 0, "max": 0}
    allocate, free = FlatParamGroup.allocate, FlatParamGroup.free

    def counting_allocate(self):
        if not self.gathered:
            peak["now"] += self.spec.padded_numel
            peak["max"] = max(peak["max"], peak["now"])
        allocate(self)

    def counting_free(self):
        if self.gathered:
            peak["now"] -= self.spec.padded_numel
        free(self)

    monkeypatch.setattr(FlatParamGroup, "allocate", counting_allocate)
    monkeypatch.setattr(FlatParamGroup, "free", counting_free)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=ProcessMesh.single(), init_seed=7)
    sizes = sorted((g.padded_numel for g in engine.layout.groups), reverse=True)
    assert peak["max"] <= sizes[0] + sizes[1]  # the root plus one block, never the whole model
    assert peak["now"] == 0
    torch.manual_seed(7)
    eager = LlamaForCausalLM(cfg)
    full = engine.gather_full_params()
    assert all(torch.equal(full[n], p) for n, p in eager.named_parameters())
    assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
    assert torch.equal(engine.module.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)


def test_meta_module_without_an_initializer_is_refused():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))

        def forward(self, x):
            return x * self.w

    with torch.device("meta"):
        model = Bare()
    with pytest.raises(ConfigError, match="reset_parameters"):
        ZeroEngine(model, process_mesh=ProcessMesh.single())
    with torch.device("meta"):
        model = Bare()
    engine = ZeroEngine(model, process_mesh=ProcessMesh.single(),
                        init_fn=lambda m: nn.init.constant_(m.w, 3.0) if m is model else None)
    assert torch.equal(engine.gather_full_params()["w"], torch.full((4,), 3.0))


def test_tied_parameters_in_separately_gathered_units_are_refused():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Block()
            self.b = Block()
            self.b.fc.weight = self.a.fc.weight

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(ConfigError, match="tied parameters span units"):
        ZeroEngine(Tied(), policy=Block, process_mesh=ProcessMesh.single())


class MixedSmall(Small):
    """Block ``b`` in bf16 (its own flat group), the rest in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.b.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(self.a(x).to(torch.bfloat16)).float())


def test_mixed_dtype_groups_train_with_fp32_masters():
    torch.manual_seed(0)
    engine = ZeroEngine(MixedSmall(), policy=Block, process_mesh=ProcessMesh.single())
    opt = ShardedAdamW(engine, lr=1e-2)
    for _ in range(2):
        F.mse_loss(engine(torch.randn(4, 8)), torch.zeros(4, 1)).backward()
        opt.step()
        opt.zero_grad()
    assert {(g.unit, g.dtype) for g in engine.layout.groups} == {
        ("a", "float32"), ("b", "bfloat16"), ("", "float32")}
    shards = engine.local_shards()["model.u0001.bfloat16"]
    assert shards["master"].dtype == torch.float32 and shards["exp_avg"].abs().sum() > 0
    compute = engine.groups["model.u0001.bfloat16"].compute
    assert compute.dtype == torch.bfloat16 and torch.equal(compute, shards["master"].bfloat16())


def test_clip_grad_norm_matches_torch():
    engine = _engine(seed=4)
    tokens = _tokens()
    causal_lm_loss(engine(tokens), tokens).backward()
    torch.manual_seed(4)
    ref = LlamaForCausalLM(CFG)
    causal_lm_loss(ref(tokens), tokens).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    norm = engine.clip_grad_norm_(0.1)
    assert norm == pytest.approx(expected.item(), rel=1e-5) and norm > 0.1
    for name, g in engine.groups.items():
        flat = torch.cat([ref.get_parameter(s.fqn).grad.reshape(-1) for s in g.param_specs])
        assert torch.allclose(g.grad[:flat.numel()], flat, rtol=1e-5, atol=1e-9)
