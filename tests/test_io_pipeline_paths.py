"""The two loads that take the read pipeline besides ``load`` (shardckpt.checkpoint.tensor_reads),
on CPU, the pipeline forced as it is for device tensors: the node-local tier's direct load
(``load_direct``, ``SHARDCKPT_IO_PIPELINE=1``) and DCP's ``ShardckptReader(pipeline=True)``.
Bit-exact whatever the ring (1, 2, many buffers; spans straddling buffers), a flipped bit named
by file and chunk, a reader thread that dies ends in an error, not a hang. The peer stream into
the ring is tested with real ranks in ``integration/test_peer_transfer.py``."""

from __future__ import annotations

import os
import re
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardckpt.checkpoint import tensor_reads
from shardckpt.checkpoint.set_aside import DamagedCopyError
from shardckpt.errors import CollectiveError
from shardckpt.interop.dcp.storage import ShardckptReader, ShardckptWriter
from shardckpt.storage import pipeline
from shardckpt.training.direct_load import load_direct
from shardckpt.training.save_load import save
from testing.ckpt_runs import flip_bit

from test_io_pipeline import CHUNK, engine_for, rings_made, set_ring, shards

RINGS = [(1, "4K", 1), (2, "8K", 3), (16, "4K", 8)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct")
    engine = engine_for(0)
    save(engine, str(root / "ck"), chunk_size=CHUNK)
    return str(root / "ck"), shards(engine)


@pytest.mark.parametrize("buffers,size,threads", RINGS)
def test_direct_load_through_the_pipeline_is_bit_exact_whatever_the_ring(saved, monkeypatch,
                                                                         buffers, size, threads):
    url, want = saved
    set_ring(monkeypatch, buffers, size, threads)
    monkeypatch.setenv(pipeline.ENV_PIPELINE, "1")
    made = rings_made(monkeypatch)
    other = engine_for(1)
    assert any(not torch.equal(t, want[key]) for key, t in shards(other).items())
    load_direct(other, url)
    for key, t in shards(other).items():
        assert torch.equal(t, want[key]), key
    assert len(made) == 1 and 0 < made[0].made <= buffers  # bounded: the ring, not the state


def test_direct_load_through_the_pipeline_reshards_across_buffers(saved, monkeypatch):
    url, _ = saved
    ref = engine_for(2, policy=())
    load_direct(ref, url)  # the plain path: readinto straight into the CPU shards
    set_ring(monkeypatch, 1, "4K", 2)
    monkeypatch.setenv(pipeline.ENV_PIPELINE, "1")
    made = rings_made(monkeypatch)
    again = engine_for(1, policy=())
    load_direct(again, url)
    assert made and made[0].made == 1
    for key, t in shards(again).items():
        assert torch.equal(t, shards(ref)[key]), key


def test_direct_load_through_the_pipeline_names_the_damaged_file_and_chunk(tmp_path, monkeypatch):
    save(engine_for(0), str(tmp_path / "ck"), chunk_size=CHUNK)
    path = flip_bit(str(tmp_path / "ck"), "shard-", back=90_000)
    chunk = (os.path.getsize(path) - 90_000) // CHUNK
    set_ring(monkeypatch, 2, "8K", 3)
    monkeypatch.setenv(pipeline.ENV_PIPELINE, "1")
    with pytest.raises((CollectiveError, DamagedCopyError)) as err:
        load_direct(engine_for(1), str(tmp_path / "ck"))
    msg = str(err.value)
    assert os.path.basename(path) in msg and f"chunk {chunk} " in msg and "CRC32C" in msg, msg


def _dying_reader(monkeypatch, after: int) -> None:
    real = tensor_reads.local_reader
    calls = {"n": 0}
    lock = threading.Lock()

    def dying(path, u, entry):
        read, close = real(path, u, entry)

        def read_then_die(view, pos):
            with lock:
                calls["n"] += 1
                n = calls["n"]
            if n == after:
                raise OSError(5, "Input/output error (injected)")
            read(view, pos)

        return read_then_die, close

    monkeypatch.setattr(tensor_reads, "local_reader", dying)


def _no_hang(fn) -> BaseException | None:
    out: dict = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - what the test inspects
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout=120)
    assert not th.is_alive(), "the load hung after a reader thread died"
    return out.get("error")


def test_a_reader_that_dies_ends_the_direct_load_in_an_error(saved, monkeypatch):
    url, _ = saved
    set_ring(monkeypatch, 1, "4K", 4)
    monkeypatch.setenv(pipeline.ENV_PIPELINE, "1")
    _dying_reader(monkeypatch, 5)
    err = _no_hang(lambda: load_direct(engine_for(1), url))
    assert err is not None and "injected" in str(err), err


# ---------------------------------------------------------------- DCP's storage reader


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(301, 17, generator=g),           # rows end inside chunks
            "w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "b": torch.randn(33, generator=g).double(),
            "step": torch.tensor(7, dtype=torch.int64)}


@pytest.fixture(scope="module")
def dcp_saved(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("dcp") / "ck")
    dcp.save(_state(0), storage_writer=ShardckptWriter(url, chunk_size=CHUNK))
    return url


@pytest.mark.parametrize("buffers,size,threads", RINGS)
def test_shardckpt_reader_through_the_pipeline_is_bit_exact_whatever_the_ring(
        dcp_saved, monkeypatch, buffers, size, threads):
    set_ring(monkeypatch, buffers, size, threads)
    made = rings_made(monkeypatch)
    got = _state(1)
    dcp.load(got, storage_reader=ShardckptReader(dcp_saved, pipeline=True))
    want = _state(0)
    for key, t in got.items():
        assert t.dtype == want[key].dtype and torch.equal(t, want[key]), key
    assert len(made) == 1 and 0 < made[0].made <= buffers  # bounded: the ring, not the state


def _plain_reads(monkeypatch) -> list[int]:
    """How many pieces each call of the plain path (straight into CPU memory) was given."""
    import shardckpt.checkpoint.tensor_reads as tensor_reads

    calls: list[int] = []
    real = tensor_reads.read_windows

    def spy(files, cs, threads):
        calls.append(sum(len(p) for *_, p in files))
        real(files, cs, threads)

    monkeypatch.setattr(tensor_reads, "read_windows", spy)
    return calls


def test_shardckpt_reader_reads_cpu_tensors_straight_into_them_unless_asked(dcp_saved, monkeypatch):
    """From a local disk, a CPU tensor's box is read straight into its memory (no ring);
    ``pipeline=False`` reads it in batches; ``SHARDCKPT_IO_PIPELINE=1`` sends it through the ring."""
    made, plain = rings_made(monkeypatch), _plain_reads(monkeypatch)
    got = _state(1)
    dcp.load(got, storage_reader=ShardckptReader(dcp_saved))
    assert made == [] and sum(plain) == 4  # a box each: emb, w, b and step
    assert all(torch.equal(t, _state(0)[k]) for k, t in got.items())
    plain.clear()
    got = _state(1)
    dcp.load(got, storage_reader=ShardckptReader(dcp_saved, pipeline=False))
    assert made == [] and sum(plain) == 0 and all(torch.equal(t, _state(0)[k]) for k, t in got.items())
    monkeypatch.setenv(pipeline.ENV_PIPELINE, "1")  # the knob: CPU tensors through the ring
    got = _state(1)
    dcp.load(got, storage_reader=ShardckptReader(dcp_saved))
    assert len(made) == 1 and sum(plain) == 0
    assert all(torch.equal(t, _state(0)[k]) for k, t in got.items())


def test_shardckpt_reader_reads_cpu_tensors_from_an_object_store_in_batches(monkeypatch):
    url = "memory://dcp-plain/ck"
    dcp.save(_state(0), storage_writer=ShardckptWriter(url, chunk_size=CHUNK))
    made, plain = rings_made(monkeypatch), _plain_reads(monkeypatch)
    got = _state(1)
    dcp.load(got, storage_reader=ShardckptReader(url))
    assert made == [] and sum(plain) == 0
    assert all(torch.equal(t, _state(0)[k]) for k, t in got.items())


@pytest.mark.parametrize("through", [True, None])  # the ring; straight into the CPU tensors
def test_shardckpt_reader_names_the_damaged_file_and_chunk(tmp_path, monkeypatch, through):
    url = str(tmp_path / "ck")
    dcp.save(_state(0), storage_writer=ShardckptWriter(url, chunk_size=CHUNK))
    path = flip_bit(url, "chunks-", back=5000)
    chunk = (os.path.getsize(path) - 5000) // CHUNK
    set_ring(monkeypatch, 2, "8K", 3)
    with pytest.raises(CheckpointException) as err:  # DCP's wrapper of every rank's failure
        dcp.load(_state(1), storage_reader=ShardckptReader(url, pipeline=through))
    msg = "".join(str(e) for e, _ in err.value.failures.values())
    assert os.path.basename(path) in msg and re.search(f"chunk {chunk}[ :]", msg) and "CRC32C" in msg, msg


def test_a_reader_that_dies_ends_the_dcp_load_in_an_error(dcp_saved, monkeypatch):
    set_ring(monkeypatch, 1, "4K", 4)
    _dying_reader(monkeypatch, 3)
    err = _no_hang(lambda: dcp.load(_state(1), storage_reader=ShardckptReader(dcp_saved,
                                                                             pipeline=True)))
    msg = "" if err is None else str(err) + "".join(
        str(e) for e, _ in getattr(err, "failures", {}).values())
    assert "injected" in msg, msg


def test_the_pipeline_knob_is_checked():
    from shardckpt.errors import ConfigError
    from shardckpt.storage.pipeline import IOConfig

    assert not IOConfig.from_env({}).every_device
    assert IOConfig.from_env({pipeline.ENV_PIPELINE: "1"}).every_device
    assert not IOConfig.from_env({pipeline.ENV_PIPELINE: "0"}).every_device
    with pytest.raises(ConfigError, match="SHARDCKPT_IO_PIPELINE='yes': expected 0 or 1"):
        IOConfig.from_env({pipeline.ENV_PIPELINE: "yes"})
