"""The pipelined load (shardckpt.storage.pipeline, shardckpt.training.device_load) on CPU
(``SHARDCKPT_IO_PIPELINE=1``): the same code as on a GPU with pinned memory off. Bit-exact round trips whatever the ring, spans that
straddle buffers, a flipped bit named by file and chunk, a dying reader that ends in an error."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from shardckpt.errors import CollectiveError, ConfigError, IntegrityError
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.storage import pipeline
from shardckpt.storage.pipeline import IOConfig, Ring, run_workers, windows
from shardckpt.training.save_load import load, save
from testing.ckpt_runs import flip_bit

CHUNK = 4096


class Wide(nn.Module):
    """About 40 k parameters: a shard file of ~0.5 MB, 120-odd chunks of 4 KiB."""

    def __init__(self, units: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(units))
        self.head = nn.Linear(64, 33)  # an odd size: spans end inside chunks

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def engine_for(seed: int, policy=(nn.Linear,)):
    torch.manual_seed(seed)
    net = Wide()
    for p in net.parameters():
        nn.init.normal_(p)
    engine = ZeroEngine(net, policy=policy)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    engine(torch.randn(2, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    return engine


def shards(engine):
    return {(g, k): t.clone() for g, kinds in engine.local_shards().items() for k, t in kinds.items()}


@pytest.fixture(autouse=True)
def through_the_ring(monkeypatch):
    """CPU shards take the ring here, as shards on a device do (their plain path, straight into
    their memory, is tests/test_plain_load.py's)."""
    monkeypatch.setenv(pipeline.ENV_PIPELINE, "1")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    engine = engine_for(0)
    save(engine, str(root / "ck"), chunk_size=CHUNK)
    return str(root / "ck"), shards(engine)


def rings_made(monkeypatch) -> list[Ring]:
    """The rings made from now on in this test."""
    made: list[Ring] = []
    real = Ring.__init__

    def spy(self, n, nbytes, alloc):
        real(self, n, nbytes, alloc)
        made.append(self)

    monkeypatch.setattr(Ring, "__init__", spy)
    return made


def loads_bit_exact(url: str, want: dict) -> None:
    """A fresh engine of another seed loads ``url`` into shards equal to ``want``, bit for bit."""
    other = engine_for(1)
    assert any(not torch.equal(t, want[key]) for key, t in shards(other).items())
    res = load(other, url)
    assert shards(other).keys() == want.keys()
    for key, t in shards(other).items():
        assert torch.equal(t, want[key]), key
    assert 0 < res.bytes_read <= sum(t.numel() * t.element_size() for t in want.values())


def set_ring(monkeypatch, buffers: int, size: str, threads: int) -> None:
    monkeypatch.setenv(pipeline.ENV_BUFFERS, str(buffers))
    monkeypatch.setenv(pipeline.ENV_BUFFER_SIZE, size)
    monkeypatch.setenv(pipeline.ENV_THREADS, str(threads))


@pytest.mark.parametrize("buffers,size,threads", [(1, "4K", 1), (1, "12K", 4), (2, "8K", 3),
                                                  (16, "4K", 8), (3, "64M", 2)])
def test_round_trip_is_bit_exact_whatever_the_ring(saved, monkeypatch, buffers, size, threads):
    url, want = saved
    set_ring(monkeypatch, buffers, size, threads)
    made = rings_made(monkeypatch)
    loads_bit_exact(url, want)
    # the host memory of the load is the ring, never the state's size
    ring = made[-1]
    assert ring.made <= buffers and ring.nbytes == IOConfig.from_env().slot_bytes(CHUNK)


def test_load_into_another_unit_policy_reads_spans_across_buffers(saved, monkeypatch):
    """A load-time reshard of the layout (another unit policy: every span lands elsewhere)
    through one 4 KiB buffer: every span straddles buffers."""
    url, _ = saved
    set_ring(monkeypatch, 1, "4K", 3)
    ref = engine_for(0, policy=())
    load(ref, url)  # the state by fqn, through the same pipeline with another grouping
    again = engine_for(1, policy=())
    set_ring(monkeypatch, 5, "16K", 2)
    load(again, url)
    assert shards(ref).keys() == shards(again).keys()
    for key, t in shards(again).items():
        assert torch.equal(t, shards(ref)[key]), key
    back = engine_for(2)
    from shardckpt.training.save_load import save as save_again

    save_again(ref, url + "-b", chunk_size=CHUNK)
    load(back, url + "-b")
    for key, t in shards(back).items():
        assert torch.equal(t, saved[1][key]), key


def test_windows_cover_touched_chunks_and_cut_straddling_spans():
    pieces = [(100, 9000, "a"), (9000, 9100, "b"), (20000, 20001, "c")]
    got = windows(20480, 4096, pieces, per_window=2)
    assert [(w0, w1) for w0, w1, _ in got] == [(0, 8192), (8192, 12288), (16384, 20480)]
    assert got[0][2] == [("a", 0, 100, 8192)]
    assert got[1][2] == [("a", 8092, 0, 808), ("b", 0, 808, 908)]
    assert got[2][2] == [("c", 0, 3616, 3617)]


def test_a_flipped_bit_in_the_middle_fails_the_load_naming_file_and_chunk(tmp_path, monkeypatch):
    engine = engine_for(0)
    save(engine, str(tmp_path / "ck"), chunk_size=CHUNK)
    path = flip_bit(str(tmp_path / "ck"), "shard-", back=90_000)
    set_ring(monkeypatch, 2, "8K", 3)
    with pytest.raises(CollectiveError) as err:
        load(engine_for(1), str(tmp_path / "ck"))
    msg = str(err.value)
    import os

    size = os.path.getsize(path)
    chunk = (size - 90_000) // CHUNK
    assert os.path.basename(path) in msg and f"chunk {chunk} " in msg and "CRC32C" in msg


def test_a_reader_that_dies_ends_the_load_in_an_error_not_a_hang(saved, monkeypatch):
    url, _ = saved
    set_ring(monkeypatch, 1, "4K", 4)
    real = pipeline.local_reader
    calls = {"n": 0}

    def dying(path, u, entry):
        read, close = real(path, u, entry)

        def read_then_die(view, pos):
            calls["n"] += 1
            if calls["n"] == 5:
                raise OSError(5, "Input/output error (injected)")
            read(view, pos)

        return read_then_die, close

    monkeypatch.setattr(pipeline, "local_reader", dying)
    import shardckpt.checkpoint.tensor_reads as tensor_reads

    monkeypatch.setattr(tensor_reads, "local_reader", dying)
    out: dict = {}

    def run():
        try:
            load(engine_for(1), url)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout=120)
    assert not th.is_alive(), "the load hung after a reader died"
    assert isinstance(out.get("error"), CollectiveError) and "injected" in str(out["error"])


def test_run_workers_raises_the_first_error_while_others_wait_for_a_buffer():
    ring = Ring(1, 8, lambda n: (memoryview(bytearray(n)), None))
    held = threading.Event()

    def fn(item, abort):
        if item == 0:
            ring.acquire(abort)  # holds the only buffer, then dies without giving it back
            held.set()
            raise IntegrityError("worker 0 died")
        held.wait()
        ring.acquire(abort)  # blocks: no buffer comes back; the failure must end the wait
        raise AssertionError("a buffer appeared")

    out: dict = {}

    def run():
        try:
            run_workers(range(4), fn, 4, "test")
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout=60)
    assert not th.is_alive(), "a worker waiting for a buffer hung after another one died"
    assert isinstance(out.get("error"), IntegrityError) and "worker 0 died" in str(out["error"])


def test_io_knobs_are_checked():
    assert IOConfig.from_env({}) == IOConfig()
    cfg = IOConfig.from_env({pipeline.ENV_BUFFERS: "2", pipeline.ENV_BUFFER_SIZE: "10K",
                             pipeline.ENV_THREADS: "3"})
    assert (cfg.buffers, cfg.buffer_bytes, cfg.threads) == (2, 10_000, 3)
    assert cfg.slot_bytes(4096) == 8192 and cfg.slot_bytes(1 << 20) == 1 << 20
    with pytest.raises(ConfigError, match="SHARDCKPT_IO_BUFFERS"):
        IOConfig.from_env({pipeline.ENV_BUFFERS: "0"})
