"""The stream reads of storage that is not mapped (object stores; here ``memory://``): a batch's
runs, of one file or many, are all in flight at once, the bytes are those of the file, and a
read that fails in a worker thread fails the batch (an error, never a hang)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from shardckpt.format.manifest import FileEntry
from shardckpt.storage import REMOTE_READS_IN_FLIGHT, RangeReader, Storage

CS = 64 << 10
DATA = bytes(range(256)) * (CS * 16 // 256)  # 16 chunks


@pytest.fixture
def stored() -> tuple[Storage, FileEntry]:
    storage = Storage(f"memory://remote-reads-{uuid.uuid4().hex}")
    with storage.writer("f.bin", CS) as w:
        w.write(DATA)
        size, crc, chunks = w.close()
    return storage, FileEntry("f.bin", "shard", size, 0, crc, chunks, 0)


def _requests(entry: FileEntry, n: int) -> list[tuple[FileEntry, int, int]]:
    """``n`` ranges of one file, each in a chunk of its own (none meet, none share a chunk)."""
    return [(entry, k * 2 * CS + 100, k * 2 * CS + 5000) for k in range(n)]


def test_runs_of_one_file_are_in_flight_together_and_read_its_bytes(stored: Any) -> None:
    storage, entry = stored
    assert not storage.backend.can_map
    n = 8
    assert REMOTE_READS_IN_FLIGHT >= n
    together = threading.Barrier(n, timeout=60)  # passes only with n reads in flight at once
    plain = storage.read

    def read(rel: str, start: int | None = None, end: int | None = None) -> bytes:
        together.wait()
        return plain(rel, start, end)

    storage.read = read  # type: ignore[method-assign]
    reqs = _requests(entry, n)
    got = RangeReader(storage, CS).read_many(reqs)
    assert [bytes(g) for g in got] == [DATA[a:b] for _, a, b in reqs]


def test_a_read_that_fails_in_a_worker_fails_the_batch(stored: Any) -> None:
    storage, entry = stored
    plain = storage.read

    def read(rel: str, start: int | None = None, end: int | None = None) -> bytes:
        if start == 6 * CS:
            raise RuntimeError("a reader thread died")
        return plain(rel, start, end)

    storage.read = read  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="died"):
        RangeReader(storage, CS).read_many(_requests(entry, 8))


def test_runs_that_share_a_chunk_fetch_it_once(stored: Any) -> None:
    """Slices that do not meet but share a checksum chunk (small slots of a flat reshard) are read
    one after the other, so every chunk of the file is fetched and checked once (in flight at
    once, both would fetch the chunk they share)."""
    storage, entry = stored
    fetched: list[tuple[int, int]] = []
    plain = storage.read

    def read(rel: str, start: int | None = None, end: int | None = None) -> bytes:
        fetched.append((start or 0, end if end is not None else len(DATA)))
        time.sleep(0.05)  # a GET's latency: reads that may overlap do
        return plain(rel, start, end)

    storage.read = read  # type: ignore[method-assign]
    reqs = [(entry, 100, 3 * CS + 50), (entry, 3 * CS + 60, 5 * CS + 7), (entry, 5 * CS + 9, 6 * CS),
            (entry, 9 * CS, 11 * CS)]
    reader = RangeReader(storage, CS)
    got = reader.read_many(reqs)
    assert [bytes(g) for g in got] == [DATA[a:b] for _, a, b in reqs]
    chunks = sorted(i for a, b in fetched for i in range(a // CS, -(-b // CS)))
    assert chunks == sorted(set(chunks)) == [0, 1, 2, 3, 4, 5, 9, 10], fetched
    assert reader.bytes_read == 8 * CS
