"""Optimizer offload in one process: configuration and disk faults, the files of ``"nvme"``,
the host step bit for bit, and checkpoints that stream from and into the offload files.

Multi-rank parity at stages 1-3 lives in ``integration/test_offload_runtime.py``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from shardckpt.training.checkpointer import Checkpointer
from shardckpt.errors import ConfigError
from shardckpt.runtime import ShardedAdamW, ShardedSGD, ZeroEngine, decay_param_groups
from shardckpt.runtime.offload import files as offload_files
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.precision import MixedPrecisionPolicy
from shardckpt.runtime.zeropp import ZeroPP
from shardckpt.training.save_load import load, save
from testing.engines import assert_same_state, shard_state

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = dict(mixed_precision=MixedPrecisionPolicy(torch.bfloat16))


def _engine(stage: int = 3, **kwargs) -> ZeroEngine:
    torch.manual_seed(0)
    return ZeroEngine(LlamaForCausalLM(CFG), policy=LLAMA_POLICY, stage=stage,
                      process_mesh=ProcessMesh.single(), deterministic=True, **kwargs)


def _adamw(engine: ZeroEngine) -> ShardedAdamW:
    return ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2, betas=(0.9, 0.95))


def _train(engine: ZeroEngine, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for s in steps:
        tokens = torch.randint(0, CFG.vocab_size, (2, 8),
                               generator=torch.Generator().manual_seed(s))
        loss = causal_lm_loss(engine(tokens), tokens)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload_optimizer="gpu"), "offload_optimizer is 'gpu'"),
    (dict(offload_optimizer="nvme"), "needs offload_dir"),
    (dict(offload_optimizer="cpu", offload_dir="/tmp"), "only for offload_optimizer='nvme'"),
    (dict(offload_dir="/tmp"), "offload_optimizer is None"),
])
def test_bad_offload_settings_are_one_clear_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _engine(**kwargs)


def test_an_unwritable_offload_directory_is_refused_at_construction(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")  # a directory below a regular file cannot be created, even by root
    with pytest.raises(ConfigError, match=f"offload directory {blocker / 'off'} is not writable"):
        _engine(offload_optimizer="nvme", offload_dir=blocker / "off")


def test_a_full_disk_is_refused_when_the_optimizer_is_built(tmp_path, monkeypatch):
    engine = _engine(offload_optimizer="nvme", offload_dir=tmp_path)
    need = sum(g.shard_numel for g in engine.groups.values() if g.trainable) * 4 * 3
    monkeypatch.setattr(offload_files.os, "statvfs",
                        lambda path: SimpleNamespace(f_bavail=1, f_frsize=4096))
    with pytest.raises(ConfigError) as err:
        _adamw(engine)
    msg = str(err.value)
    assert str(tmp_path) in msg and f"needs {need} bytes" in msg and "only 4096 bytes" in msg
    assert os.listdir(tmp_path) == []  # nothing half-created


def test_nvme_files_one_per_group_and_kind_unique_per_run_removed_at_close(tmp_path):
    engines = [_engine(offload_optimizer="nvme", offload_dir=tmp_path) for _ in range(2)]
    for e in engines:
        _adamw(e)
    runs = sorted(os.listdir(tmp_path))
    assert len(runs) == 2 and all(r.startswith("shardckpt-offload-") and r.endswith("-rank00000")
                                  for r in runs)
    trained = [n for n, g in engines[0].groups.items() if g.trainable]
    want = sorted(f"{n}.{k}.bin" for n in trained for k in ("master", "exp_avg", "exp_avg_sq"))
    assert sorted(os.listdir(tmp_path / runs[0])) == want
    size = {n: g.shard_numel * 4 for n, g in engines[0].groups.items()}
    for f in want:
        assert (tmp_path / runs[0] / f).stat().st_size == size[f.split(".bin")[0].rsplit(".", 1)[0]]
    engines[0].close()
    engines[0].close()  # idempotent
    assert len(os.listdir(tmp_path)) == 1
    engines[1].close()
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- the step


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_offloaded_step_is_bit_exact_against_the_resident_one(tmp_path, stage, mode):
    base = _engine(stage)
    _train(base, _adamw(base), range(3))
    kwargs = dict(offload_dir=tmp_path) if mode == "nvme" else {}
    engine = _engine(stage, offload_optimizer=mode, **kwargs)
    opt = _adamw(engine)
    _train(engine, opt, range(3))
    assert_same_state(shard_state(base), shard_state(engine))
    # the host path ran: the store's masters are tensors of their own, not the device shards
    store = opt._offload
    assert store is not None and store.config.mode == mode
    if mode == "cpu":
        name = next(iter(store.sizes))
        assert (store._host[name]["master"].data_ptr()
                != engine.groups[name].master.data_ptr())
    engine.close()


def test_sgd_with_momentum_offloaded_is_bit_exact(tmp_path):
    base = _engine(2)
    _train(base, ShardedSGD(base, lr=1e-2, momentum=0.9), range(3))
    engine = _engine(2, offload_optimizer="nvme", offload_dir=tmp_path)
    _train(engine, ShardedSGD(engine, lr=1e-2, momentum=0.9), range(3))
    assert_same_state(shard_state(base), shard_state(engine))
    engine.close()


def test_masters_written_between_steps_reach_the_offloaded_step(tmp_path):
    """A load (or any write of the device shard plus refresh_params) is what the next step
    starts from."""
    base, engine = _engine(), _engine(offload_optimizer="nvme", offload_dir=tmp_path)
    opts = [_adamw(base), _adamw(engine)]
    for e, o in zip((base, engine), opts):
        _train(e, o, range(1))
        for kinds in e.local_shards().values():
            kinds["master"].mul_(0.5)
        e.refresh_params()
        _train(e, o, range(1, 2))
    assert_same_state(shard_state(base), shard_state(engine))
    engine.close()


# ------------------------------------------------------------------------------ checkpoints


def test_save_streams_from_the_offload_files_in_bounded_pieces(tmp_path, monkeypatch):
    engine = _engine(offload_optimizer="nvme", offload_dir=tmp_path / "off")
    _train(engine, _adamw(engine), range(2))
    monkeypatch.setattr(offload_files, "IO_CHUNK", 256)
    reads: list[int] = []
    real = offload_files.pread_into
    monkeypatch.setattr(offload_files, "pread_into",
                        lambda fd, buf, off, path: (reads.append(len(buf)), real(fd, buf, off,
                                                                                 path)))
    save(engine, str(tmp_path / "ck"))
    largest = max(g.shard_numel for g in engine.groups.values()) * 4
    assert reads and max(reads) <= 256 < largest
    engine.close()


@pytest.mark.parametrize("src, dst", [("nvme", None), (None, "nvme"), ("cpu", "nvme")])
def test_checkpoints_load_with_offload_on_or_off_bit_for_bit(tmp_path, src, dst):
    def build(mode, where):
        kw = dict(offload_optimizer=mode, offload_dir=tmp_path / where) if mode == "nvme" \
            else dict(offload_optimizer=mode)
        e = _engine(**kw)
        return e, _adamw(e)

    saver, opt = build(src, "a")
    _train(saver, opt, range(2))
    save(saver, str(tmp_path / "ck"))
    loader, opt2 = build(dst, "b")
    load(loader, str(tmp_path / "ck"))
    assert_same_state(shard_state(saver), shard_state(loader))
    _train(saver, opt, range(2, 4))
    _train(loader, opt2, range(2, 4))
    assert_same_state(shard_state(saver), shard_state(loader))
    saver.close()
    loader.close()


@pytest.mark.parametrize("mixed", [{}, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("src, dst", [("nvme", "cpu"), ("cpu", "nvme")])
def test_async_checkpointer_stages_from_the_offload_store(tmp_path, mixed, src, dst):
    def build(mode, where):
        kw = dict(offload_dir=tmp_path / where) if mode == "nvme" else {}
        e = _engine(offload_optimizer=mode, **kw, **mixed)
        return e, _adamw(e)

    engine, opt = build(src, "a")
    ckpt = Checkpointer(str(tmp_path / "run"), engine, async_save=True)
    _train(engine, opt, range(1))
    want = shard_state(engine)
    ckpt.save(1)
    _train(engine, opt, range(1, 2))
    ckpt.close()
    other, _ = build(dst, "b")
    assert Checkpointer(str(tmp_path / "run"), other).resume() == 1
    assert_same_state(want, shard_state(other))
    engine.close()
    other.close()


def test_a_weights_only_checkpoint_zeroes_the_offloaded_state(tmp_path):
    weights = _engine()  # no optimizer: the checkpoint holds masters alone
    save(weights, str(tmp_path / "ck"))
    engine = _engine(offload_optimizer="nvme", offload_dir=tmp_path / "off")
    _train(engine, _adamw(engine), range(1))
    assert any(t.any() for (g, k), t in shard_state(engine).items() if k != "master")
    load(engine, str(tmp_path / "ck"))
    state = shard_state(engine)
    assert all(not t.any() for (g, k), t in state.items() if k != "master")
    assert all(torch.equal(state[key], t) for key, t in shard_state(weights).items())
    engine.close()
    assert os.listdir(tmp_path / "off") == []


def test_a_failed_write_back_is_one_error_and_no_checkpoint_is_taken_after_it(tmp_path,
                                                                             monkeypatch):
    engine = _engine(offload_optimizer="nvme", offload_dir=tmp_path / "off")
    opt = _adamw(engine)
    _train(engine, opt, range(1))
    save(engine, str(tmp_path / "good"))
    real = offload_files.os.pwrite

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(offload_files.os, "pwrite", full)
    with pytest.raises(Exception) as err:
        _train(engine, opt, range(1, 2))
    assert "offload file" in str(err.value) and "No space left" in str(err.value)
    assert str(tmp_path / "off") in str(err.value)
    monkeypatch.setattr(offload_files.os, "pwrite", real)
    with pytest.raises(Exception, match="inconsistent"):
        save(engine, str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()
    other = _engine()
    _adamw(other)
    load(other, str(tmp_path / "good"))  # the previous checkpoint is intact
    engine.close()


# ------------------------------------------------- bf16 compute: the device keeps bf16 alone


def _offloaded(tmp_path, mode: str | None, stage: int = 3, where: str = "off", **kwargs):
    kw = dict(offload_optimizer=mode, offload_dir=tmp_path / where) if mode == "nvme" \
        else dict(offload_optimizer=mode)
    engine = _engine(stage, **kw, **BF16, **kwargs)
    return engine, _adamw(engine)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_bf16_compute_offloaded_keeps_only_bf16_on_the_device_bit_exact(tmp_path, stage, mode):
    base, base_opt = _offloaded(tmp_path, None, stage)
    engine, opt = _offloaded(tmp_path, mode, stage)
    assert _train(base, base_opt, range(3)) == _train(engine, opt, range(3))
    assert_same_state(shard_state(base), shard_state(engine))
    for name, g in engine.groups.items():  # no fp32 copy of the weights on the device
        assert g.master is None and g.shard.dtype == torch.bfloat16
        assert torch.equal(g.shard, base.groups[name].master.to(torch.bfloat16))
    held, resident = engine.model_state_bytes(), base.model_state_bytes()
    shards = sum(g.shard_numel for g in engine.groups.values())
    assert held["master"] == 2 * shards and resident["master"] == 4 * shards
    assert held["optim"] == 0 and resident["optim"] == 8 * shards
    engine.close()


@pytest.mark.parametrize("src, dst", [("cpu", None), (None, "nvme"), ("nvme", "cpu")])
def test_bf16_compute_checkpoints_round_trip_with_offload_on_or_off(tmp_path, src, dst):
    saver, opt = _offloaded(tmp_path, src, where="a")
    _train(saver, opt, range(2))
    save(saver, str(tmp_path / "ck"))
    loader, opt2 = _offloaded(tmp_path, dst, where="b")
    load(loader, str(tmp_path / "ck"))
    assert_same_state(shard_state(saver), shard_state(loader))
    assert _train(saver, opt, range(2, 4)) == _train(loader, opt2, range(2, 4))
    assert_same_state(shard_state(saver), shard_state(loader))
    saver.close()
    loader.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_bf16_compute_offloaded_summon_and_full_state_dict_write_the_store(tmp_path, mode):
    engines = [_offloaded(tmp_path, m) for m in (None, mode)]
    for e, o in engines:
        _train(e, o, range(1))
        with e.summon_full_params(writeback=True) as params, torch.no_grad():
            for p in params.values():
                p.mul_(0.5)
        _train(e, o, range(1, 2))
        full = e.full_state_dict()
        e.load_full_state_dict({k: v * 2 for k, v in full.items()})
        _train(e, o, range(2, 3))
    (base, _), (engine, _) = engines
    assert_same_state(shard_state(base), shard_state(engine))
    assert_same_state(base.full_state_dict(), engine.full_state_dict())
    engine.close()


def test_qwz_with_bf16_compute_and_offload_is_refused(tmp_path):
    engine = _engine(3, offload_optimizer="cpu", zeropp=ZeroPP(qwz=True), **BF16)
    with pytest.raises(ConfigError, match="qwZ with offload_optimizer and a compute dtype"):
        _adamw(engine)


@pytest.mark.parametrize("bf16", [True, False])
def test_offloaded_device_bytes_are_what_the_estimator_says(tmp_path, bf16):
    """The device bytes the engine holds with the optimizer offloaded (each storage once,
    gradients held) are ``shardckpt estimate --offload``'s for the same model, stage and
    precision, at every stage."""
    from shardckpt.format.footprint_levers import offload_split

    for stage in (1, 2, 3):
        kw = BF16 if bf16 else {}
        torch.manual_seed(0)
        engine = _engine(stage, offload_optimizer="cpu", **kw)
        opt = _adamw(engine)
        tokens = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        held = engine.model_state_bytes()
        assert held["optim"] == 0
        assert sum(held.values()) == offload_split(engine.estimate(), "cpu").device_bytes, (stage, held)
        engine.close()
