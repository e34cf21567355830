"""``ZeroEngine(compile_units=...)``: each non-root unit's forward under torch.compile (inductor's
C++ backend on this CPU), the hooks outside the graph, in one process (no torch.distributed).

Tolerance of the compiled run against the eager one (fp32, stage 3, AdamW lr 1e-2, 4 steps):
losses within 1e-5 relative and fp32 masters within 1e-4 absolute (1% of one step's largest
AdamW move). Measured on this machine: losses 1.2e-7 relative, masters 1.1e-5 after 10 steps,
so the bounds leave a margin of about 10x over a run more than twice as long.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from shardckpt.errors import ConfigError
from shardckpt.runtime import ShardedAdamW, ZeroEngine, checkpoint_units, decay_param_groups
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.models.llama import (LLAMA_POLICY, LlamaConfig, LlamaDecoderLayer,
                                            LlamaForCausalLM, LlamaModel, causal_lm_loss)

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)
STEPS, LR = 4, 1e-2
LOSS_RTOL, MASTER_ATOL = 1e-5, 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(cfg: LlamaConfig = CFG, **kwargs) -> ZeroEngine:
    torch.manual_seed(0)
    kwargs.setdefault("policy", LLAMA_POLICY)
    return ZeroEngine(LlamaForCausalLM(cfg), process_mesh=ProcessMesh.single(), **kwargs)


def _train(engine: ZeroEngine, steps: int, after_step=lambda: None
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=LR)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, 8),
                               generator=torch.Generator().manual_seed(step))
        loss = causal_lm_loss(engine(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        after_step()
    return torch.stack(losses), {n: k["master"].clone() for n, k in engine.local_shards().items()}


def test_compiled_units_match_the_eager_engine_without_graph_breaks():
    from torch._dynamo.utils import counters

    eager_losses, eager_masters = _train(_engine(), STEPS)
    torch._dynamo.reset()
    counters.clear()
    engine = _engine(compile_units=True)
    assert engine.compiled_units == ["model.layers.0", "model.layers.1"]
    graphs: list[int] = []
    losses, masters = _train(engine, STEPS,
                             lambda: graphs.append(counters["stats"]["unique_graphs"]))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # compiled once (both layers run one graph), then no recompilation in later steps: the
    # parameters' gathered views keep their shapes and strides from step to step
    assert graphs[0] >= 1 and graphs == [graphs[0]] * STEPS, graphs
    torch.testing.assert_close(losses, eager_losses, rtol=LOSS_RTOL, atol=0)
    for name, master in masters.items():
        torch.testing.assert_close(master, eager_masters[name], rtol=0, atol=MASTER_ATOL)
    assert all(not g.gathered for g in engine.groups.values())  # stage 3 freed every unit


@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_units_at_stages_1_and_2(stage):
    """Units stay gathered until the step: the compiled graph reads the same views throughout."""
    eager_losses, eager_masters = _train(_engine(stage=stage), STEPS)
    losses, masters = _train(_engine(stage=stage, compile_units=True), STEPS)
    torch.testing.assert_close(losses, eager_losses, rtol=LOSS_RTOL, atol=0)
    for name, master in masters.items():
        torch.testing.assert_close(master, eager_masters[name], rtol=0, atol=MASTER_ATOL)


def test_activation_checkpointing_wraps_the_compiled_forward():
    from torch._dynamo.utils import counters

    eager_losses, eager_masters = _train(_engine(), 2)
    torch._dynamo.reset()
    counters.clear()
    engine = _engine(compile_units={"fullgraph": True})
    assert checkpoint_units(engine) == ["model.layers.0", "model.layers.1"]
    losses, masters = _train(engine, 2)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    torch.testing.assert_close(losses, eager_losses, rtol=LOSS_RTOL, atol=0)
    for name, master in masters.items():
        torch.testing.assert_close(master, eager_masters[name], rtol=0, atol=MASTER_ATOL)


def test_root_and_units_that_hold_units_stay_eager():
    def nested(fqn: str, module: nn.Module) -> bool:
        return isinstance(module, (LlamaModel, LlamaDecoderLayer))

    untied = dataclasses.replace(CFG, tie_word_embeddings=False)  # the root keeps the head
    engine = _engine(untied, policy=nested, compile_units=True)
    assert [u.name for u in engine.units] == ["", "model", "model.layers.0", "model.layers.1"]
    assert engine.compiled_units == ["model.layers.0", "model.layers.1"]
    layer = engine.module.model.layers[0]
    assert "forward" in vars(layer) and "forward" not in vars(engine.module.model)
    assert "forward" not in vars(engine.module)
    assert _engine().compiled_units == []


def test_compile_and_the_bit_exact_mode_exclude_each_other():
    with pytest.raises(ConfigError, match="deterministic=True exclude each other"):
        _engine(compile_units=True, deterministic=True)
    with pytest.raises(ConfigError, match="deterministic=True exclude each other"):
        _engine(compile_units={"mode": "default"}, deterministic=True)
    assert _engine(compile_units=False, deterministic=True).compiled_units == []


@pytest.mark.parametrize("value, message", [
    ({"fullgraf": True}, "keys torch.compile does not take: fullgraf"),
    ("inductor", "use True, False or a dict"),
    (1, "use True, False or a dict"),
])
def test_bad_compile_options_are_one_error(value, message):
    with pytest.raises(ConfigError, match=message):
        _engine(compile_units=value)
