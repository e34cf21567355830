"""Async saves' staging is allocated off the training thread (shardckpt.training.staging): the
first save() does not wait for it, its size is reported, and max_staging_bytes turns it off."""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.training import staging
from shardckpt.training.checkpointer import Checkpointer
from shardckpt.training.save_load import load


def engine_for(seed: int):
    torch.manual_seed(seed)
    engine = ZeroEngine(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8)), policy=(nn.Linear,))
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    engine(torch.randn(2, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
    return engine, opt


def state(engine):
    return {(g, k): t.clone() for g, kinds in engine.local_shards().items() for k, t in kinds.items()}


def state_bytes(engine) -> int:
    return sum(t.numel() * t.element_size() for kinds in engine.local_shards().values()
               for t in kinds.values())


def test_the_first_save_does_not_wait_for_the_staging_allocation(tmp_path, monkeypatch, caplog):
    gate = threading.Event()
    real = staging.Staging._allocate

    def slow(self, shape):
        gate.wait(60)  # the allocation takes as long as the test says
        real(self, shape)

    monkeypatch.setattr(staging.Staging, "_allocate", slow)
    engine, opt = engine_for(0)
    caplog.set_level(logging.INFO, logger="shardckpt.training.staging")
    ck = Checkpointer(str(tmp_path / "run"), engine, async_save=True)
    want = state(engine)
    assert ck.staging_bytes == 0
    ck.save(1)  # returns while the allocation is still held up
    assert ck.in_flight and not ck._staged.is_set()
    gate.set()
    ck.wait_staged()
    engine(torch.randn(2, 32)).sum().backward()
    opt.step()  # the state changes once staged; the checkpoint keeps step 1's
    ck.wait()
    assert ck.staging_bytes == state_bytes(engine)
    assert sum("for staging" in r.getMessage() for r in caplog.records) == 1
    other, _ = engine_for(1)
    load(other, str(tmp_path / "run" / "step-00000001"))
    for key, t in state(other).items():
        assert torch.equal(t, want[key]), key
    ck.save(2)
    ck.wait()
    assert sum("for staging" in r.getMessage() for r in caplog.records) == 1  # allocated once
    ck.close()


def test_max_staging_bytes_turns_staging_off_and_updates_wait_for_the_write(tmp_path):
    engine, _ = engine_for(0)
    ck = Checkpointer(str(tmp_path / "run"), engine, async_save=True, max_staging_bytes=1024)
    assert ck.staging_bytes == 0
    want = state(engine)
    ck.save(1)
    ck.wait_staged()  # what the next update waits for: here the whole write and commit
    assert (tmp_path / "run" / "step-00000001" / "manifest.json").exists()
    ck.wait()
    assert ck.staging_bytes == 0
    other, _ = engine_for(1)
    load(other, str(tmp_path / "run" / "step-00000001"))
    for key, t in state(other).items():
        assert torch.equal(t, want[key]), key
    ck.close()
