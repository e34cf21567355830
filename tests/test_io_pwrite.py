"""The parallel positioned save (shardckpt.storage.pwrite, shardckpt.training.device_save) on CPU:
the same bytes and checksums as the streamed write whatever the ring and the threads; ENOSPC in
the middle of a parallel write fails the save, commits nothing and keeps the previous checkpoint;
a writer that dies ends the save in an error, never a hang."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch
from torch import nn

from shardckpt.errors import CollectiveError, ShardckptError
from shardckpt.format.integrity import crc32c
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.storage import pwrite
from shardckpt.format.digests import digest_of
from shardckpt.storage.digest import ChunkHasher, hash_chunks
from shardckpt.storage.pipeline import IOConfig, Ring
from shardckpt.storage.pwrite import Staged, plan, write_positioned
from shardckpt.storage.writer import StreamWriter
from shardckpt.training.checkpointer import Checkpointer
from shardckpt.training.device_load import host_ring
from shardckpt.training.save_load import load

CHUNK = 4096


class HostStaged(Staged):
    """Bytes that must be staged (as a device tensor's are), here from host memory."""

    def __init__(self, data: bytes) -> None:
        self.t, self.nbytes = torch.frombuffer(bytearray(data), dtype=torch.uint8), len(data)

    def stage(self, a, b, slot, lo):
        slot.handle[lo:lo + b - a].copy_(self.t[a:b])


def streamed(tmp_path, parts: list[bytes]) -> tuple[int, int, tuple[int, ...]]:
    class Sink:
        def write(self, view):
            pass

        def close(self, size):
            pass

        def abort(self):
            pass

    w = StreamWriter(Sink, str(tmp_path), CHUNK)
    for p in parts:
        w.write(p)
    return w.close()


@pytest.mark.parametrize("buffers,size,threads,algorithm", [
    (1, 4096, 1, "sha256"), (2, 8192, 3, "blake3"), (16, 4096, 8, "sha256"), (3, 1 << 20, 2, "blake3")])
def test_positioned_write_gives_the_streamed_bytes_and_checksums(tmp_path, buffers, size, threads, algorithm):
    rng = torch.Generator().manual_seed(buffers)
    raw = [bytes(torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).tolist())
           for n in (100, 10_000, 0, 5000, 4096, 1)]
    parts = [raw[0], HostStaged(raw[1]), raw[2], raw[3], HostStaged(raw[4]), raw[5]]
    cfg = IOConfig(buffers, size, threads)
    ring = host_ring(cfg, cfg.slot_bytes(CHUNK), pinned=False)
    hasher = ChunkHasher(CHUNK, algorithm)
    got = write_positioned(str(tmp_path / "f.bin"), "f", parts, CHUNK, cfg, ring, hasher=hasher)
    data = (tmp_path / "f.bin").read_bytes()
    assert data == b"".join(raw)
    assert got == streamed(tmp_path, raw) and got[1] == crc32c(data)
    # the digest of the parallel write is the file's, as the streamed write and verify compute it
    assert hasher.hexdigest() == hash_chunks([data], CHUNK, algorithm) == digest_of(data, CHUNK, algorithm)
    assert ring.made <= buffers


def test_plan_cuts_parts_that_straddle_windows():
    size, wins = plan([b"h" * 100, b"x" * 9000, b"", b"y" * 10], 4096, 1)
    assert size == 9110
    assert wins == [(0, 4096, [(0, 0, 100), (1, 0, 3996)]), (4096, 8192, [(1, 3996, 8092)]),
                    (8192, 9110, [(1, 8092, 9000), (3, 0, 10)])]


def engine_for(seed: int):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 33))
    engine = ZeroEngine(net, policy=(nn.Linear,))
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    engine(torch.randn(2, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    return engine


def state(engine):
    return {(g, k): t.clone() for g, kinds in engine.local_shards().items() for k, t in kinds.items()}


def test_enospc_in_the_middle_fails_the_save_and_keeps_the_previous_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_IO_BUFFER_SIZE", "4K")
    monkeypatch.setenv("SHARDCKPT_IO_THREADS", "4")
    engine = engine_for(0)
    ck = Checkpointer(str(tmp_path / "run"), engine, keep_last=2, chunk_size=CHUNK)
    ck.save(1)
    good = state(engine)
    real, calls = os.pwritev, {"n": 0}

    def full_disk(fd, views, pos):
        calls["n"] += 1
        if calls["n"] == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, views, pos)

    monkeypatch.setattr(pwrite.os, "pwritev", full_disk)
    with torch.no_grad():
        for kinds in engine.local_shards().values():
            for t in kinds.values():
                t.add_(1)
    with pytest.raises(CollectiveError, match="No space left|ENOSPC|space"):
        ck.save(2)
    assert calls["n"] >= 6  # it failed inside the parallel write
    monkeypatch.setattr(pwrite.os, "pwritev", real)
    step2 = tmp_path / "run" / "step-00000002"
    assert not (step2 / "manifest.json").exists()
    left = [f for _, _, fs in os.walk(step2) for f in fs if f.startswith("shard-")]
    assert left == []  # the half-written shard file is gone
    fresh = engine_for(1)
    assert Checkpointer(str(tmp_path / "run"), fresh, keep_last=2).resume() == 1
    for key, t in state(fresh).items():
        assert torch.equal(t, good[key]), key


def test_a_writer_that_dies_ends_the_save_in_an_error_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_IO_BUFFER_SIZE", "4K")
    monkeypatch.setenv("SHARDCKPT_IO_BUFFERS", "1")
    monkeypatch.setenv("SHARDCKPT_IO_THREADS", "4")
    engine = engine_for(0)
    real, calls = os.pwritev, {"n": 0}

    def dying(fd, views, pos):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("writer died (injected)")
        return real(fd, views, pos)

    monkeypatch.setattr(pwrite.os, "pwritev", dying)
    out: dict = {}

    def run():
        try:
            Checkpointer(str(tmp_path / "run"), engine, chunk_size=CHUNK).save(1)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout=120)
    assert not th.is_alive(), "the save hung after a writer died"
    assert isinstance(out.get("error"), CollectiveError) and "injected" in str(out["error"])
    assert not (tmp_path / "run" / "step-00000001" / "manifest.json").exists()


def test_a_staged_part_that_fails_removes_the_file(tmp_path):
    class Broken(Staged):
        nbytes = 10_000

        def stage(self, a, b, slot, lo):
            raise ShardckptError("device copy failed (injected)")

    cfg = IOConfig(2, 4096, 3)
    ring = Ring(2, 4096, lambda n: (memoryview(bytearray(n)), None))
    with pytest.raises(ShardckptError, match="injected"):
        write_positioned(str(tmp_path / "f.bin"), "f", [b"h" * 10, Broken()], CHUNK, cfg, ring)
    assert not (tmp_path / "f.bin").exists()


def test_parallel_save_round_trips_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_IO_BUFFER_SIZE", "8K")
    monkeypatch.setenv("SHARDCKPT_IO_THREADS", "3")
    engine = engine_for(0)
    calls = {"n": 0}
    real = os.pwritev

    def counting(fd, views, pos):
        calls["n"] += 1
        return real(fd, views, pos)

    monkeypatch.setattr(pwrite.os, "pwritev", counting)
    Checkpointer(str(tmp_path / "run"), engine, chunk_size=CHUNK).save(1)
    assert calls["n"] > 3  # the shard file went through the parallel positioned write
    other = engine_for(1)
    load(other, str(tmp_path / "run" / "step-00000001"))
    for key, t in state(other).items():
        assert torch.equal(t, state(engine)[key]), key
