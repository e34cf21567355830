"""Engines the runtime and save/load suites build and train the same way.

- :func:`train_tiny`: the tiny Llama's engine run of a :func:`testing.reference.tiny_reference`
  configuration; :func:`tiny_engine` and :func:`tiny_step` for suites that drive it step by step.
- :func:`llama_engine`, :func:`llama_batches`, :func:`train_llama`: the small Llama (``LLAMA``)
  with AdamW that the save/load, checkpointer and crash-safety jobs save and load.
- :func:`assert_same_state`: two engines' states equal, tensor by tensor (the offload suites).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from testing.models import BETAS, LLAMA, LR, TINY_STEPS, WD, tiny_batch, tiny_llama, tiny_loss


def train_tiny(pm, stage: int, micro: int = 1, mp: Any = None, accumulate: str = "per_micro",
               clip: float | None = None, ac: bool = False, steps: int = TINY_STEPS,
               after_backward: Callable[[Any], None] | None = None,
               deterministic: bool = True) -> tuple[Any, list[float]]:
    """The engine's run of :func:`testing.reference.tiny_reference`'s configuration on this rank."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, checkpoint_units, decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY

    engine = ZeroEngine(tiny_llama(), policy=LLAMA_POLICY, process_mesh=pm,
                        deterministic=deterministic, stage=stage, mixed_precision=mp)
    if ac:
        checkpoint_units(engine)
    opt = ShardedAdamW(engine, decay_param_groups(engine, WD), lr=LR, betas=BETAS)
    norms = []
    for step in range(steps):
        for m in range(micro):
            tokens = tiny_batch(step, m, pm.rank)
            sync = accumulate == "per_micro" or m == micro - 1
            engine.set_requires_gradient_sync(sync)
            tiny_loss(engine(tokens), tokens, micro).backward()
        if after_backward is not None:
            after_backward(engine)
        if clip is not None:
            norms.append(engine.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()
    return engine, norms


def tiny_engine(pm, **kwargs: Any):
    """The tiny Llama in an engine with ``kwargs``, and its AdamW."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY

    kwargs.setdefault("deterministic", True)
    engine = ZeroEngine(tiny_llama(), policy=LLAMA_POLICY, process_mesh=pm, **kwargs)
    return engine, ShardedAdamW(engine, decay_param_groups(engine, WD), lr=LR, betas=BETAS)


def tiny_step(engine, opt, i: int, rank: int, zero: bool = True) -> float:
    tokens = tiny_batch(i, 0, rank)
    loss = tiny_loss(engine(tokens), tokens, 1)
    loss.backward()
    opt.step()
    if zero:
        opt.zero_grad()
    return float(loss.detach())


def llama_engine(pm, seed: int, policy: str = "layers"):
    """The small Llama (with a ``calibration`` buffer) seeded with ``seed`` in a deterministic
    engine (units: layers, or attention and MLP), and its AdamW: ``(config, engine, opt)``."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups, units_by_type
    from shardckpt.runtime.models.llama import (LLAMA_POLICY, LlamaAttention, LlamaConfig, LlamaForCausalLM,
                                         LlamaMLP)

    cfg = LlamaConfig(**LLAMA)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.register_buffer("calibration", torch.arange(5, dtype=torch.float32) * (seed + 1))
    pol = LLAMA_POLICY if policy == "layers" else units_by_type(LlamaAttention, LlamaMLP)
    engine = ZeroEngine(model, policy=pol, process_mesh=pm, deterministic=True)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-3, betas=(0.9, 0.95))
    return cfg, engine, opt


def llama_batches(cfg, rank: int, world: int):
    from shardckpt.runtime.data import SyntheticCorpus, TokenBatches

    return TokenBatches(SyntheticCorpus(cfg.vocab_size, seed=1), seq_len=16, micro_batch=2,
                        rank=rank, world_size=world)


def train_llama(engine, opt, data, steps: range) -> None:
    from shardckpt.runtime.models.llama import causal_lm_loss

    for step in steps:
        tokens = data.batch(step)
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def shard_state(engine: Any) -> dict[tuple[str, str], Any]:
    """(group, kind) -> a copy of this rank's shard, for every kind ``local_shards()`` gives;
    state in an offload file is read back into a host tensor."""
    import torch

    out = {}
    for g, kinds in engine.local_shards().items():
        for k, t in kinds.items():
            if not isinstance(t, torch.Tensor):  # an offload file
                host = torch.empty(t.shape, dtype=t.dtype)
                t.read_into(host)
                t = host
            out[g, k] = t.clone()
    return out


def assert_same_state(a: dict, b: dict) -> None:
    """Two engines' states (name -> tensor) hold the same keys and equal tensors; the keys that
    differ are named."""
    import torch

    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad}"
