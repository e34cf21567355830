"""An async checkpoint of an engine whose optimizer is offloaded to files (``"nvme"``): the
trained groups are copied into a snapshot on the offload disk, not into memory, streamed from
there, and the snapshot is removed when the save finishes or fails."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardckpt.errors import ShardckptError
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.runtime.offload import files as offload_files
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.training.checkpointer import Checkpointer
from shardckpt.training.save_load import SaveJob, save

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(where: Path) -> tuple[ZeroEngine, ShardedAdamW]:
    torch.manual_seed(0)
    engine = ZeroEngine(LlamaForCausalLM(CFG), policy=LLAMA_POLICY, stage=3,
                        process_mesh=ProcessMesh.single(), deterministic=True,
                        offload_optimizer="nvme", offload_dir=where)
    return engine, ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)


def _train(engine: ZeroEngine, opt: ShardedAdamW, steps: range) -> None:
    for s in steps:
        tokens = torch.randint(0, CFG.vocab_size, (2, 8),
                               generator=torch.Generator().manual_seed(s))
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def _shard_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    files = sorted(ckpt.glob("*/shard-*.safetensors"))
    assert files, f"no shard files under {ckpt}"
    return {k: v for f in files for k, v in load_file(f).items()}


def _snapshots(opt: ShardedAdamW) -> list[str]:
    run_dir = opt._offload.run_dir
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("snapshot-"))


def test_async_save_copies_on_the_offload_disk_and_equals_a_sync_save(tmp_path, monkeypatch):
    engine, opt = _engine(tmp_path / "off")
    _train(engine, opt, range(2))
    save(engine, str(tmp_path / "sync"))
    ckpt = Checkpointer(str(tmp_path / "run"), engine, async_save=True)
    monkeypatch.setattr(offload_files, "IO_CHUNK", 256)
    reads: list[int] = []
    real_read = offload_files.pread_into
    monkeypatch.setattr(offload_files, "pread_into",
                        lambda fd, buf, off, path: (reads.append(len(buf)),
                                                    real_read(fd, buf, off, path)))
    gate, real_write = threading.Event(), SaveJob.write_files
    monkeypatch.setattr(SaveJob, "write_files",
                        lambda job, writer: (gate.wait(120), real_write(job, writer))[1])
    ckpt.save(2)
    ckpt.wait_staged()
    assert len(_snapshots(opt)) == 1
    assert ckpt.staging_bytes == 0  # every group is trained: nothing of the model state staged in memory
    _train(engine, opt, range(2, 3))  # the live files change while the save streams the copy
    gate.set()
    ckpt.close()
    assert _snapshots(opt) == []
    largest = max(g.shard_numel for g in engine.groups.values()) * 4
    assert reads and max(reads) <= 256 < largest
    want = _shard_tensors(tmp_path / "sync")
    got = _shard_tensors(tmp_path / "run" / "step-00000002")
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    engine.close()


@pytest.mark.parametrize("where", ["snapshot", "write"])
def test_a_failed_async_save_commits_nothing_and_leaves_no_snapshot(tmp_path, monkeypatch,
                                                                   where):
    engine, opt = _engine(tmp_path / "off")
    _train(engine, opt, range(1))
    ckpt = Checkpointer(str(tmp_path / "run"), engine, async_save=True)
    if where == "snapshot":  # copying the files on the offload disk fails (a full disk)
        def full(src, dst, nbytes, path):
            raise ShardckptError(f"offload snapshot {path}: No space left on device")
        monkeypatch.setattr(offload_files, "_copy_range", full)
    else:  # streaming the snapshot into the checkpoint fails half-way
        real = offload_files.OffloadedShard.iter_bytes

        def broken(self, chunk=None):
            it = real(self, chunk)
            yield next(it)
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(offload_files.OffloadedShard, "iter_bytes", broken)
    ckpt.save(1)
    with pytest.raises(Exception) as err:
        ckpt.wait()
    assert ("No space left" if where == "snapshot" else "Input/output error") in str(err.value)
    assert not ckpt.manager.is_committed(1)
    assert not (tmp_path / "run" / "latest").exists()
    assert _snapshots(opt) == []
    monkeypatch.undo()
    _train(engine, opt, range(1, 2))  # training and saving go on
    ckpt.save(2)
    ckpt.close()
    assert ckpt.manager.is_committed(2)
    engine.close()
