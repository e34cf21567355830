"""The node-local tier's spare file (``LocalTier.preallocate``): after a save each rank allocates
its next shard file, and its next save writes over those pages; the bytes saved are the same,
the spare never outlives the tier, and a spare that cannot be made or taken changes nothing but
the speed. One process, a real ``Checkpointer`` and real files."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.tiers import SPARE_NAME, LocalTier
from shardckpt.errors import LinkRefusedError
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM
from shardckpt.storage import Storage
from shardckpt.storage.private_dir import private_storage
from shardckpt.storage.pwrite import write_positioned
from shardckpt.storage.pipeline import IOConfig
from shardckpt.storage.spare import Spare
from shardckpt.training.checkpointer import Checkpointer

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
#: state large enough (5 MB) that the room a save plans for its headers (64 KiB) is small beside it
WIDER = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
SPARE = SPARE_NAME.format(rank=0)

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(seed: int = 0, cfg: LlamaConfig = CFG) -> ZeroEngine:
    torch.manual_seed(seed)
    engine = ZeroEngine(LlamaForCausalLM(cfg), policy=LLAMA_POLICY, process_mesh=ProcessMesh.single())
    ShardedAdamW(engine, decay_param_groups(engine, 0.0), lr=1e-3)
    return engine


def _ckpt(tmp_path, engine: ZeroEngine, **tier) -> Checkpointer:
    return Checkpointer(str(tmp_path / "run"), engine, durable_every=100,
                        local=LocalTier(path=str(tmp_path / "shm"), every=1, peers=0, **tier))


def _shard_file(tmp_path, step: int) -> str:
    here = Storage(str(tmp_path / "shm" / f"step-{step:08d}"))
    entry = next(e for e in read_manifest(here).files if e.role == "shard")
    return here.full(entry.path)


def _state(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    return {f"{g}.{k}": t.clone() for g, kinds in engine.local_shards().items() for k, t in kinds.items()}


def test_the_next_save_writes_over_the_spare_and_saves_the_same_bytes(tmp_path):
    engine = _engine()
    ckpt = _ckpt(tmp_path, engine)
    spare = str(tmp_path / "shm" / SPARE)
    ckpt.save(1)
    ckpt.wait()
    first = _shard_file(tmp_path, 1)
    assert os.path.getsize(spare) == os.path.getsize(first)
    assert os.stat(spare).st_blocks * 512 >= os.path.getsize(first)  # allocated, not a hole
    assert oct(os.stat(spare).st_mode & 0o777) == oct(0o600)
    inode = os.stat(spare).st_ino
    with torch.no_grad():  # the state the second save holds differs from the first's
        for kinds in engine.local_shards().values():
            for t in kinds.values():
                t.add_(1)
    saved = _state(engine)
    ckpt.save(2)
    ckpt.wait()
    second = _shard_file(tmp_path, 2)
    assert os.stat(second).st_ino == inode  # the spare's pages, renamed into place
    assert os.path.exists(spare) and os.stat(spare).st_ino != inode  # and the next one is ready
    ckpt.close()
    assert not os.path.exists(spare)  # given back at close
    other = _engine(seed=1)
    resumed = _ckpt(tmp_path, other)
    assert resumed.resume() == 2
    got = _state(other)
    assert got.keys() == saved.keys()
    for k in saved:
        assert torch.equal(got[k].view(torch.uint8), saved[k].view(torch.uint8)), k
    resumed.close()


def test_no_spare_without_preallocate_or_past_the_quota(tmp_path):
    ckpt = _ckpt(tmp_path, _engine(cfg=WIDER), preallocate=False)
    ckpt.save(1)
    ckpt.wait()
    assert not os.path.exists(tmp_path / "shm" / SPARE)
    ckpt.close()
    used = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(tmp_path / "shm") for n in ns)
    shard = os.path.getsize(_shard_file(tmp_path, 1))
    # room for the next save beside step 1 (keep=2), not for a spare beside both
    ckpt = Checkpointer(str(tmp_path / "run"), _engine(cfg=WIDER), durable_every=100,
                        local=LocalTier(path=str(tmp_path / "shm"), every=1, peers=0,
                                        quota_bytes=2 * used + shard // 2))
    ckpt.save(2)
    ckpt.wait()
    assert ckpt.tier is not None and ckpt.tier.enabled
    assert os.path.exists(_shard_file(tmp_path, 2))  # committed
    assert not os.path.exists(tmp_path / "shm" / SPARE)
    ckpt.close()


def test_the_first_spare_is_started_by_a_save_call_that_saves_nothing_and_taken_by_the_next(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "run"), _engine(), durable_every=100,
                        local=LocalTier(path=str(tmp_path / "shm"), every=2, peers=0))
    assert ckpt.tier is not None and ckpt.tier.spare is not None
    assert ckpt.resume() == 0
    assert not (tmp_path / "shm" / SPARE).exists()  # nothing made while a resume reads
    ckpt.save(1)  # not due: nothing saved, the first spare started
    ckpt.tier.spare.settle()
    inode = os.stat(tmp_path / "shm" / SPARE).st_ino
    ckpt.save(2)
    ckpt.wait()
    assert os.stat(_shard_file(tmp_path, 2)).st_ino == inode
    ckpt.close()


def test_a_spare_left_by_an_earlier_process_is_replaced_and_one_that_cannot_be_made_is_none(
        tmp_path, monkeypatch):
    (tmp_path / "shm").mkdir(mode=0o700)
    (tmp_path / "shm" / SPARE).write_bytes(b"x" * 4096)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    ckpt = _ckpt(tmp_path, _engine())
    assert ckpt.tier is not None and ckpt.tier.spare is not None
    ckpt.tier.spare.settle()
    assert not os.path.exists(tmp_path / "shm" / SPARE)  # the old one removed, no new one
    ckpt.save(1)
    ckpt.wait()  # the save commits; no spare is made, and nothing of one is left
    assert ckpt.tier.enabled and ckpt.tier.spare.nbytes == 0
    assert not os.path.exists(tmp_path / "shm" / SPARE)
    monkeypatch.undo()
    ckpt.save(2)
    ckpt.wait()
    assert os.path.getsize(tmp_path / "shm" / SPARE) == os.path.getsize(_shard_file(tmp_path, 2))
    ckpt.close()
    assert not os.path.exists(tmp_path / "shm" / SPARE)


def _write(storage: Storage, rel: str, data: bytes, spare: Spare | None) -> tuple[int, int, tuple[int, ...]]:
    opener = storage.write_opener(rel, spare)
    assert opener is not None
    return write_positioned(storage.full(rel), storage.url_of(rel), [np.frombuffer(data, np.uint8)],
                            4096, IOConfig(buffer_bytes=8192, threads=2), open_fd=opener)


@pytest.mark.parametrize("spare_size", [100, 20_000, 70_000])
def test_a_taken_spare_is_cut_or_grown_to_what_is_written(tmp_path, spare_size):
    storage = private_storage(str(tmp_path / "node"))
    data = os.urandom(30_000)
    plain = _write(storage, "a/plain", data, None)
    spare = Spare(storage, ".spare")
    assert spare.prepare(spare_size) and spare.nbytes == spare_size
    assert _write(storage, "b/over", data, spare) == plain
    assert open(storage.full("b/over"), "rb").read() == data
    assert spare.nbytes == 0 and not os.path.exists(storage.full(".spare"))
    assert _write(storage, "c/again", data, spare) == plain  # none ready: a new file


def test_a_spare_gone_before_it_is_taken_gives_a_new_file_and_a_link_is_refused(tmp_path):
    storage = private_storage(str(tmp_path / "node"))
    data = os.urandom(10_000)
    spare = Spare(storage, ".spare")
    spare.prepare(10_000)
    os.unlink(storage.full(".spare"))  # removed behind the tier's back
    _write(storage, "f", data, spare)
    assert open(storage.full("f"), "rb").read() == data
    spare.prepare(10_000)
    os.unlink(storage.full(".spare"))
    os.symlink(str(tmp_path / "elsewhere"), storage.full(".spare"))
    (tmp_path / "elsewhere").write_bytes(b"theirs")
    with pytest.raises(LinkRefusedError):
        _write(storage, "g", data, spare)
    assert (tmp_path / "elsewhere").read_bytes() == b"theirs"
