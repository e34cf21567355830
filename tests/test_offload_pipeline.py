"""The offloaded step's group pipeline and its multi-threaded host step, in one process: the
order of the stages, the resident run's bits with the elements split over threads, the ring
sized per group, the fused AdamW opt-in, and failures (one error, no hang, the store refused
after). Multi-rank parity of the default (pipelined) step is in
``integration/test_offload_runtime.py``.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.runtime import ShardedAdamW, ShardedSGD, ZeroEngine, decay_param_groups
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.offload import OffloadConfig
from shardckpt.runtime.offload.host_step import slice_items
from shardckpt.runtime.precision import MixedPrecisionPolicy
from shardckpt.training.save_load import save
from testing.engines import assert_same_state, shard_state

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1)

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = dict(mixed_precision=MixedPrecisionPolicy(torch.bfloat16))


def _engine(stage: int = 3, offload=None, **kwargs) -> ZeroEngine:
    torch.manual_seed(0)
    return ZeroEngine(LlamaForCausalLM(CFG), policy=LLAMA_POLICY, stage=stage,
                      process_mesh=ProcessMesh.single(), deterministic=True,
                      offload_optimizer=offload, **kwargs)


def _config(mode: str, tmp_path, **kwargs) -> OffloadConfig:
    return OffloadConfig(mode, tmp_path / "off" if mode == "nvme" else None, **kwargs)


def _adamw(engine: ZeroEngine) -> ShardedAdamW:
    return ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2, betas=(0.9, 0.95))


def _backward(engine: ZeroEngine, s: int) -> None:
    tokens = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(s))
    causal_lm_loss(engine(tokens), tokens).backward()


def _train(engine: ZeroEngine, opt, steps: range) -> None:
    for s in steps:
        _backward(engine, s)
        opt.step()
        opt.zero_grad()


@functools.cache
def _resident(stage: int, bf16: bool) -> dict:
    base = _engine(stage, **(BF16 if bf16 else {}))
    _train(base, _adamw(base), range(3))
    return shard_state(base)


def _threaded(engine: ZeroEngine, opt, threads_seen: set[str], sizes: list[int]) -> None:
    """Small slices (the groups of this model are below one default slice), and record which
    threads ran the update on how many elements."""
    opt._offload._stepper.slice = 96  # not a multiple of 64: any boundary keeps the bits
    real = opt._update_segments

    def update(master, grad, state, items):
        threads_seen.add(threading.current_thread().name)
        sizes.append(master.numel())
        real(master, grad, state, items)

    opt._update_segments = update
    engine._schedule.listener.update = update


# ----------------------------------------------------------------------------- the bits


@pytest.mark.parametrize("stage, bf16", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlap"])
def test_the_pipelined_step_on_three_threads_is_bit_exact(tmp_path, stage, bf16, mode, overlap):
    """Each group's elements split into slices of 96 stepped by a pool of three threads: the
    resident run's bits, with the step in ``step()`` or overlapping backward."""
    engine = _engine(stage, _config(mode, tmp_path, host_threads=3, overlap_step=overlap),
                     **(BF16 if bf16 else {}))
    opt = _adamw(engine)
    threads, sizes = set(), []
    _threaded(engine, opt, threads, sizes)
    _train(engine, opt, range(3))
    assert_same_state(_resident(stage, bf16), shard_state(engine))
    largest = max(g.shard_numel for g in engine.groups.values())
    assert max(sizes) <= 96 < largest
    assert len(threads) > 1 and all(t.startswith("shardckpt-offload-step") for t in threads)
    engine.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_the_unpipelined_step_stays_selectable_and_bit_exact(tmp_path, mode):
    engine = _engine(3, _config(mode, tmp_path, pipeline=False))
    opt = _adamw(engine)
    _train(engine, opt, range(3))
    assert_same_state(_resident(3, False), shard_state(engine))
    assert opt._offload._pipeline is None and "unpipelined" in engine.offload.describe()
    engine.close()


def test_slices_of_the_work_items_cover_each_segment_once():
    from shardckpt.runtime.optim import _Segment

    items = [(_Segment(None, 0, 50), 1, "a"), (_Segment(None, 50, 70), 2, "b"),
             (_Segment(None, 70, 200), 1, "a")]
    covered = []
    for lo in range(0, 200, 64):
        for seg, step, hyper in slice_items(items, lo, min(lo + 64, 200)):
            covered += [(lo + i, step, hyper) for i in range(seg.lo, seg.hi)]
    assert covered == [(i, s, h) for seg, s, h in items for i in range(seg.lo, seg.hi)]


# ---------------------------------------------------------------------------- the order


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_the_next_groups_gradient_comes_in_before_this_group_steps(tmp_path, mode):
    """Group k+1's copy in is queued before group k's step, group k's copy out before group
    k+1's step, and a slot is reused only after its previous group went out."""
    engine = _engine(3, _config(mode, tmp_path))
    opt = _adamw(engine)
    pipe = opt._offload._pipeline
    pipe.trace = trace = []
    _backward(engine, 0)
    assert trace == [] and opt._offload._grads == {}  # nothing copied in backward
    opt.step()
    names = [n for stage, n in trace if stage == "step"]
    assert len(names) == len(opt._offload.sizes) >= 4 and len(trace) == 3 * len(names)
    at = {event: i for i, event in enumerate(trace)}
    assert at["copy_in", names[0]] == 0
    for k, name in enumerate(names):
        assert at["copy_in", name] < at["step", name] < at["copy_out", name]
        if k + 1 < len(names):
            assert at["copy_in", names[k + 1]] < at["step", name]
            assert at["copy_out", name] < at["step", names[k + 1]]
        if k >= 1 and k + 1 < len(names):  # group k+1 takes the slot of group k-1
            assert at["copy_out", names[k - 1]] < at["copy_in", names[k + 1]]
    engine.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_pipeline_alone_moves_gradients_in_and_cast_weights_out(device):
    """The pipeline on its own, five groups of uneven sizes through a ring of two slots: each
    step sees its group's gradient, each device shard receives its cast master; on CUDA through
    pinned slots, side streams and events."""
    from shardckpt.runtime.offload.pipeline import StepPipeline

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    sizes = {f"g{i}": n for i, n in enumerate([48, 160, 32, 96, 160])}
    masters = {n: torch.randn(k, generator=gen) for n, k in sizes.items()}
    grads = {n: torch.randn(k, generator=gen).to(dev) for n, k in sizes.items()}
    shards = {n: torch.zeros(k, dtype=torch.bfloat16, device=dev) for n, k in sizes.items()}
    want = {n: (masters[n] + grads[n].cpu()).to(torch.bfloat16) for n in sizes}
    pipe = StepPipeline(dev, pin=dev.type == "cuda")
    pipe.trace = []
    seen = {}

    def step(name, window, grad):
        seen[name] = grad.clone()
        window["master"].add_(grad)

    names = list(sizes)
    pipe.run(names, ((n, {"master": masters[n]}) for n in names), grads, shards, step)
    assert all(torch.equal(seen[n], grads[n].cpu()) for n in names)
    assert all(torch.equal(shards[n].cpu(), want[n]) for n in names)
    assert pipe.buffer_bytes == 2 * 160 * (4 + 2)
    assert pipe._ring.is_pinned() == (dev.type == "cuda")
    assert [s for s, n in pipe.trace if n == "g2"] == ["copy_in", "step", "copy_out"]


@pytest.mark.parametrize("bf16", [False, True])
def test_the_ring_is_sized_per_group_not_per_model(tmp_path, bf16):
    engine = _engine(3, "cpu", **(BF16 if bf16 else {}))
    opt = _adamw(engine)
    _train(engine, opt, range(1))
    store = opt._offload
    largest = max(store.sizes.values())
    itemsize = 2 if bf16 else 4
    assert store._pipeline.buffer_bytes == 2 * largest * (4 + itemsize)
    assert store._grads == {} and store._grad is None  # no host gradient copy per group
    assert store.pinned_bytes == 0  # nothing is pinned without CUDA
    assert store._pipeline.buffer_bytes < 4 * sum(store.sizes.values())
    engine.close()


# ------------------------------------------------------------------------- fused opt-in


def test_fused_adamw_is_an_opt_in_close_to_the_resident_run(tmp_path, monkeypatch):
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    engine = _engine(3, _config("cpu", tmp_path, fused_adamw=True))
    opt = _adamw(engine)
    _train(engine, opt, range(3))
    assert len(calls) >= 3 * len(opt._offload.sizes)
    assert "fused AdamW (not bit-exact)" in engine.offload.describe()
    want = _resident(3, False)
    got = shard_state(engine)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    engine.close()
    sgd = _engine(3, _config("cpu", tmp_path, fused_adamw=True))
    with pytest.raises(ConfigError, match="fused_adamw is for AdamW"):
        ShardedSGD(sgd, lr=1e-2, momentum=0.9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload=OffloadConfig("cpu", host_threads=0)), "host_threads is 0"),
    (dict(offload=OffloadConfig("cpu"), offload_overlap_step=True),
     "set directory and overlap_step in it"),
    (dict(offload=OffloadConfig("nvme")), "needs offload_dir"),
])
def test_bad_offload_configs_are_one_clear_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _engine(3, **kwargs)


# ----------------------------------------------------------------------------- failures


def _fail_second(pipe, method: str):
    real = getattr(pipe, method)
    seen = []

    def fake(slot, name, *args):
        seen.append(name)
        if len(seen) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(slot, name, *args)

    setattr(pipe, method, fake)
    return seen


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("method, stage", [("_copy_in", "copy in"), ("_copy_out", "copy out")])
def test_a_failed_copy_is_one_error_and_the_store_is_refused_after(tmp_path, mode, method,
                                                                   stage):
    engine = _engine(3, _config(mode, tmp_path, host_threads=3))
    opt = _adamw(engine)
    _train(engine, opt, range(1))
    save(engine, str(tmp_path / "good"))
    seen = _fail_second(opt._offload._pipeline, method)
    _backward(engine, 1)
    with pytest.raises(ShardckptError) as err:
        opt.step()
    msg = str(err.value)
    assert f"flat group {seen[1]} ({stage})" in msg and "illegal memory access" in msg
    with pytest.raises(ShardckptError, match="inconsistent"):
        opt.step()
    with pytest.raises(ShardckptError, match="inconsistent"):
        save(engine, str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists() and (tmp_path / "good").exists()
    engine.close()
    if mode == "nvme":  # the files are gone even after the failure
        assert list((tmp_path / "off").iterdir()) == []


def test_a_slice_that_fails_on_a_pool_thread_is_one_error(tmp_path):
    engine = _engine(3, _config("cpu", tmp_path, host_threads=3))
    opt = _adamw(engine)
    opt._offload._stepper.slice = 96
    real = opt._update_segments
    calls = []

    def update(master, grad, state, items):
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("bad slice")
        real(master, grad, state, items)

    opt._update_segments = update
    _backward(engine, 0)
    with pytest.raises(ShardckptError, match=r"\(step\): FloatingPointError: bad slice"):
        opt.step()
    with pytest.raises(ShardckptError, match="inconsistent"):
        opt.step()
    engine.close()


def test_a_stuck_slice_times_out_instead_of_hanging(tmp_path):
    engine = _engine(3, _config("cpu", tmp_path, host_threads=2))
    opt = _adamw(engine)
    stepper = opt._offload._stepper
    stepper.slice, stepper.timeout_s = 96, 0.5
    release = threading.Event()
    real = opt._update_segments

    def update(master, grad, state, items):
        if threading.current_thread().name.endswith("_0"):
            release.wait(60)
        real(master, grad, state, items)

    opt._update_segments = update
    _backward(engine, 0)
    try:
        with pytest.raises(ShardckptError, match="did not finish within"):
            opt.step()
    finally:
        release.set()
    with pytest.raises(ShardckptError, match="inconsistent"):
        opt.step()
    engine.close()
