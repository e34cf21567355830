"""Offloaded optimizer in one process: gradients go to the host as their reductions finish,
and with ``offload_overlap_step`` each group's host step runs on the offload worker while
backward goes on; bit for bit the resident run either way, and the rule's misuses refused.

Multi-rank parity at stages 1-3 lives in ``integration/test_offload_runtime.py``.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from shardckpt.errors import ConfigError
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.offload import OffloadConfig
from shardckpt.runtime.precision import MixedPrecisionPolicy
from testing.engines import assert_same_state, shard_state

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(stage: int = 3, mode: str | None = None, where=None, **kwargs) -> ZeroEngine:
    torch.manual_seed(0)
    if mode == "nvme":  # (an OffloadConfig carries its own directory)
        kwargs["offload_dir"] = where
    return ZeroEngine(LlamaForCausalLM(CFG), policy=LLAMA_POLICY, stage=stage,
                      process_mesh=ProcessMesh.single(), deterministic=True,
                      offload_optimizer=mode, **kwargs)


def _adamw(engine: ZeroEngine) -> ShardedAdamW:
    return ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2, betas=(0.9, 0.95))


def _tokens(s: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(s))


def _backward(engine: ZeroEngine, s: int, micro: int = 1) -> None:
    for m in range(micro):  # gradient accumulation: only the last micro-batch syncs
        tokens = _tokens(100 * s + m)
        engine.set_requires_gradient_sync(m == micro - 1)
        causal_lm_loss(engine(tokens), tokens).backward()


def _train(engine: ZeroEngine, opt, steps: range, micro: int = 1, clip: float | None = None):
    for s in steps:
        _backward(engine, s, micro)
        if clip is not None:
            engine.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()


@functools.cache
def _resident(stage: int) -> dict[tuple[str, str], torch.Tensor]:
    """The resident run's state after three steps of two micro-batches (one per stage)."""
    base = _engine(stage)
    _train(base, _adamw(base), range(3), micro=2)
    return shard_state(base)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_the_step_overlapping_backward_is_bit_exact(tmp_path, stage, mode):
    """Two micro-batches per step (no_sync for the first), three steps."""
    engine = _engine(stage, mode, tmp_path, offload_overlap_step=True)
    _train(engine, _adamw(engine), range(3), micro=2)
    assert_same_state(_resident(stage), shard_state(engine))
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_the_overlapping_step_with_bf16_compute_keeps_bf16_alone_on_the_device(tmp_path, stage,
                                                                               mode):
    """The early step casts the updated master into the bf16 device shard on the host."""
    bf16 = dict(mixed_precision=MixedPrecisionPolicy(torch.bfloat16))
    base = _engine(stage, **bf16)
    _train(base, _adamw(base), range(3), micro=2)
    engine = _engine(stage, mode, tmp_path, offload_overlap_step=True, **bf16)
    _train(engine, _adamw(engine), range(3), micro=2)
    assert_same_state(shard_state(base), shard_state(engine))
    assert all(g.master is None and g.shard.dtype == torch.bfloat16
               for g in engine.groups.values())
    engine.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_clipping_scales_the_host_copies_made_in_backward_bit_exact(tmp_path, mode):
    base = _engine(2)
    _train(base, _adamw(base), range(3), clip=0.05)
    engine = _engine(2, mode, tmp_path)
    opt = _adamw(engine)
    _train(engine, opt, range(3), clip=0.05)
    assert_same_state(shard_state(base), shard_state(engine))
    engine.close()


def test_gradients_reach_the_host_in_backward_and_the_step_waits_for_step(tmp_path):
    """Unpipelined (the step as it was, kept for comparison): each reduced gradient is on the
    host once backward is done; no update ran."""
    engine = _engine(3, OffloadConfig("nvme", tmp_path, pipeline=False))
    opt = _adamw(engine)
    calls: list[str] = []
    real = opt._update_segments
    opt._update_segments = lambda *a: (calls.append(threading.current_thread().name), real(*a))
    two = _engine(3)  # two synced backward passes: the host copy follows the second
    two_opt = _adamw(two)
    for e in (engine, two):
        _backward(e, 0)
        _backward(e, 1)
    store = opt._offload
    store.drain()
    assert not calls
    trained = [n for n, g in engine.groups.items() if g.trainable]
    assert sorted(store._grads) == sorted(trained)
    assert all(torch.equal(store._grads[n], engine.groups[n].grad) for n in trained)
    opt.step()
    two_opt.step()
    assert len(calls) == len(trained) and "shardckpt-offload" not in calls[0]
    assert_same_state(shard_state(two), shard_state(engine))
    engine.close()


def test_the_first_reduced_group_steps_before_backward_ends(tmp_path):
    """An ordering claim, no timings: the second reduction waits until the first group's step
    has started on the worker; a step that began only after backward would never let it go."""
    engine = _engine(3, "nvme", tmp_path, offload_overlap_step=True)
    opt = _adamw(engine)
    started = threading.Event()
    log: list[tuple[str, str, bool]] = []
    listener = engine._schedule.listener
    real_update, real_reduced = listener.update, listener.grad_reduced

    def update(*args):
        log.append(("step", threading.current_thread().name, False))
        started.set()
        real_update(*args)

    def reduced(group):
        if len(log) and log[0][0] == "reduced" and not started.is_set():
            assert started.wait(120), "the first group's step did not start during backward"
        log.append(("reduced", group.name, engine.in_backward))
        real_reduced(group)

    listener.update = update
    listener.grad_reduced = reduced
    _backward(engine, 0)
    trained = [n for n, g in engine.groups.items() if g.trainable]
    kinds = [k for k, _, _ in log]
    assert kinds[:3] == ["reduced", "step", "reduced"], kinds
    assert all(in_bw for k, _, in_bw in log if k == "reduced")
    assert all(name.startswith("shardckpt-offload") for k, name, _ in log if k == "step")
    opt.step()
    assert kinds.count("reduced") == len(trained) and len(log) == 2 * len(trained)
    engine.close()


def test_misuses_of_the_overlapping_step_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="needs offload_optimizer"):
        _engine(3, None, offload_overlap_step=True)
    engine = _engine(3, "cpu", offload_overlap_step=True)
    opt = _adamw(engine)
    _backward(engine, 0)
    with pytest.raises(ConfigError, match="clip_grad_norm_ with offload_overlap_step"):
        engine.clip_grad_norm_(1.0)
    with pytest.raises(ConfigError, match="reduced again before optimizer.step"):
        _backward(engine, 1)
    engine = _engine(3, "cpu", offload_overlap_step=True)
    opt = _adamw(engine)
    _backward(engine, 0)
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(ConfigError, match="set the learning rate"):
        opt.step()
