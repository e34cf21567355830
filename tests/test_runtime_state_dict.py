"""``state_dict()`` of a wrapped module and of a sharded optimizer: whole tensors or one clear
error, never 0-element placeholders; shape-based param groups that placeholders would fool."""

from __future__ import annotations

import pytest
import torch

from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.mesh import ProcessMesh

CFG = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2)

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(stage: int = 3) -> ZeroEngine:
    torch.manual_seed(0)
    return ZeroEngine(LlamaForCausalLM(CFG), policy=LLAMA_POLICY,
                      process_mesh=ProcessMesh.single(), stage=stage)


def _step(engine: ZeroEngine, opt: ShardedAdamW) -> None:
    tokens = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    causal_lm_loss(engine(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()


def _whole_or_refused(engine: ZeroEngine, module: torch.nn.Module) -> None:
    """``module.state_dict()`` holds every parameter whole, or raises the one clear error."""
    try:
        sd = module.state_dict()
    except ConfigError as e:
        assert "placeholder" in str(e) and "engine.full_state_dict()" in str(e), e
        assert "Checkpointer" in str(e), e
        return
    for key, t in sd.items():
        fqn = engine.tied_aliases.get(key, key)
        if engine.layout.has_param(fqn):
            assert tuple(t.shape) == engine.layout.param(fqn).shape, (key, t.shape)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_module_state_dict_is_never_placeholders(stage):
    engine = _engine(stage)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1))
    for _ in range(2):  # before the first step, then between steps
        _whole_or_refused(engine, engine.module)
        _whole_or_refused(engine, engine.module.model.layers[0])
        _step(engine, opt)


def test_stage3_state_dict_names_the_way_out():
    engine = _engine(3)
    with pytest.raises(ConfigError, match=r"model\.embed_tokens\.weight is a 0-element placeholder "
                                          r"\(its shape is \[256, 32\]\)"):
        engine.module.state_dict()
    with pytest.raises(ConfigError, match="engine.full_state_dict"):
        torch.save(engine.module.model.layers[1].state_dict(), "/dev/null")
    # the collective way still gives whole tensors, in state_dict() key order
    full = engine.full_state_dict()
    assert full["model.embed_tokens.weight"].shape == (256, 32)
    assert list(full) == list(LlamaForCausalLM(CFG).state_dict())


def test_load_state_dict_into_placeholders_names_the_way_in():
    engine = _engine(3)
    whole = LlamaForCausalLM(CFG).state_dict()
    with pytest.raises(ConfigError, match=r"load_state_dict\(\): .* engine\.load_full_state_dict"):
        engine.module.load_state_dict(whole)
    engine.load_full_state_dict(whole)
    assert all(torch.equal(engine.full_state_dict()[k], v) for k, v in whole.items())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_of_the_wrapped_module_refuses(tmp_path):
    import torch.distributed.checkpoint as dcp

    engine = _engine(3)
    with pytest.raises(Exception, match="engine.full_state_dict") as ei:
        dcp.save({"model": engine.module}, checkpoint_id=str(tmp_path / "dcp"))
    assert "placeholder" in str(ei.value)
    assert not (tmp_path / "dcp" / ".metadata").exists()


def test_optimizer_state_dict_says_where_to_go():
    engine = _engine(3)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1))
    with pytest.raises(ShardckptError, match="Checkpointer") as ei:
        opt.state_dict()
    assert "ShardedAdamW.state_dict()" in str(ei.value)
    with pytest.raises(ShardckptError, match="Checkpointer"):
        opt.load_state_dict({})


def test_shape_based_param_groups_are_refused():
    """``p.ndim < 2`` on placeholders calls every parameter a vector: no decay anywhere."""
    engine = _engine(3)
    named = list(engine.named_parameters())
    assert all(p.ndim == 1 and p.numel() == 0 for _, p in named)  # placeholders, as documented
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    with pytest.raises(ConfigError, match=r"decay_param_groups\(engine, weight_decay\)"):
        ShardedAdamW(engine, groups)
    decay, plain = decay_param_groups(engine, 0.1)
    assert decay["params"] and plain["params"]  # the layout's shapes tell them apart
