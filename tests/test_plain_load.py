"""A load into CPU shards from a local disk takes the plain path: every span read straight into
the shards' own memory in windows of whole chunks on several threads
(shardckpt.storage.read_windows), every chunk checked, no ring and no copy. Bit-exact whatever
the windows and threads, across another grouping, a damaged chunk named by file and chunk; an
object store or ``SHARDCKPT_IO_PIPELINE=1`` still takes the ring."""

from __future__ import annotations

import os

import pytest
import torch

from shardckpt.errors import CollectiveError
from shardckpt.storage import local_windows, pipeline
from shardckpt.training.save_load import load, save
from testing.ckpt_runs import flip_bit

from test_io_pipeline import CHUNK, engine_for, loads_bit_exact, rings_made, shards


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    engine = engine_for(0)
    save(engine, str(root / "ck"), chunk_size=CHUNK)
    return str(root / "ck"), shards(engine)


@pytest.mark.parametrize("window_chunks,threads", [(1, 1), (3, 2), (5, 8), (4096, 4)])
def test_round_trip_is_bit_exact_whatever_the_windows(saved, monkeypatch, window_chunks, threads):
    url, want = saved
    monkeypatch.setattr(local_windows, "WINDOW_BYTES", window_chunks * CHUNK)
    monkeypatch.setenv(pipeline.ENV_THREADS, str(threads))
    made = rings_made(monkeypatch)
    loads_bit_exact(url, want)
    assert made == []  # straight into the shards: no ring


def test_another_grouping_reads_spans_across_windows(saved, monkeypatch):
    """Another unit policy: every span lands elsewhere in the shards, and windows of two chunks
    cut most of them; the state by name is the same as through the ring."""
    url, _ = saved
    monkeypatch.setattr(local_windows, "WINDOW_BYTES", 2 * CHUNK)
    plain = engine_for(1, policy=())
    load(plain, url)
    monkeypatch.setenv(pipeline.ENV_PIPELINE, "1")
    made = rings_made(monkeypatch)
    ringed = engine_for(2, policy=())
    load(ringed, url)
    assert len(made) == 1
    assert shards(plain).keys() == shards(ringed).keys()
    for key, t in shards(plain).items():
        assert torch.equal(t, shards(ringed)[key]), key


def test_a_flipped_bit_fails_the_load_naming_file_and_chunk(tmp_path, monkeypatch):
    save(engine_for(0), str(tmp_path / "ck"), chunk_size=CHUNK)
    path = flip_bit(str(tmp_path / "ck"), "shard-", back=90_000)
    monkeypatch.setattr(local_windows, "WINDOW_BYTES", 3 * CHUNK)
    made = rings_made(monkeypatch)
    with pytest.raises(CollectiveError) as err:
        load(engine_for(1), str(tmp_path / "ck"))
    chunk = (os.path.getsize(path) - 90_000) // CHUNK
    msg = str(err.value)
    assert os.path.basename(path) in msg and f"chunk {chunk}: " in msg and "CRC32C" in msg, msg
    assert made == []


def test_an_object_store_still_takes_the_ring(monkeypatch):
    url = "memory://plain-load/ck"
    engine = engine_for(0)
    save(engine, url, chunk_size=CHUNK)
    made = rings_made(monkeypatch)
    other = engine_for(1)
    load(other, url)
    assert len(made) == 1
    for key, t in shards(other).items():
        assert torch.equal(t, shards(engine)[key]), key
