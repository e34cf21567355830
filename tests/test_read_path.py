"""The checked read path (:mod:`shardckpt.storage.reads`): ranges across chunk boundaries,
coalescing, boundary chunks read once, corruption named, mapped local files and fsspec reads
giving the same bytes, the read-ahead loop; and the backend a storage chooses once."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Iterator

import crc32c as crc32c_pkg
import numpy as np
import pytest

from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import RangeReader, Storage, read_ahead
from shardckpt.storage.backends import Backend
from shardckpt.storage.local import LocalBackend
from shardckpt.storage.memory import MemoryBackend

CHUNK = 4096
HEADER = 2  # the entries' header size: data starts at byte 10


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def entry_of(rel: str, data: bytes) -> FileEntry:
    """The manifest entry of ``data``, its checksums computed independently of shardckpt."""
    chunks = tuple(crc32c_pkg.crc32c(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK))
    return FileEntry(rel, "shard", len(data), HEADER, crc32c_pkg.crc32c(data), chunks, 0)


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield Storage(str(tmp_path / "root"))
        return
    url = f"memory://reads-{uuid.uuid4().hex}"
    yield Storage(url)
    Storage(url).rm("", recursive=True)


def put(storage: Storage, rel: str, data: bytes) -> FileEntry:
    storage.put(rel, data)
    return entry_of(rel, data)


def count_reads(storage: Storage) -> list[tuple[Any, Any]]:
    """Record every raw read (start, end) the storage makes."""
    calls: list[tuple[Any, Any]] = []
    real = storage.read

    def read(rel: str, start: Any = None, end: Any = None) -> bytes:
        calls.append((start, end))
        return real(rel, start, end)
    storage.read = read  # type: ignore[method-assign]
    return calls


RANGES = [(10, 20), (CHUNK - 3, CHUNK + 3), (CHUNK + 3, 3 * CHUNK + 1), (2 * CHUNK, 2 * CHUNK),
          (4 * CHUNK - 1, 5 * CHUNK + 50), (0, 5 * CHUNK + 50)]


# ----------------------------------------------------------------------------- backends


def test_the_backend_is_chosen_once_per_location(tmp_path: Path) -> None:
    local, mem = Storage(str(tmp_path)), Storage(f"memory://b-{uuid.uuid4().hex}")
    assert type(local.backend) is LocalBackend and local.backend.can_map == (os.name == "posix")
    assert type(mem.backend) is MemoryBackend and not mem.backend.can_map
    child = local.child("a/b")
    assert child.backend is local.backend and child.url == f"{tmp_path}/a/b"
    assert child.full("x") == f"{tmp_path}/a/b/x"


def test_staged_writes_are_installed_where_the_backend_needs_it(storage: Storage) -> None:
    staged = storage.staging_name("w.bin", "abc")
    local = isinstance(storage.backend, LocalBackend)
    assert staged == ("w.bin.partial-abc" if local else "w.bin")
    with storage.writer(staged, CHUNK) as w:
        w.write(b"data")
        w.close()
    storage.install(staged, "w.bin")
    assert storage.read("w.bin") == b"data" and storage.ls("") == ["w.bin"]


# ------------------------------------------------------------------------- one read path


def test_ranges_across_chunk_boundaries(storage: Storage) -> None:
    data = payload(5 * CHUNK + 50)
    e = put(storage, "f.bin", data)
    reqs = [(e, a, b) for a, b in RANGES]
    want = [data[a:b] for a, b in RANGES]
    assert [bytes(v) for v in RangeReader(storage, CHUNK).gather(reqs)] == want
    assert [bytes(v) for v in RangeReader(storage, CHUNK).read_many(reqs)] == want
    assert [bytes(v) for v in RangeReader(storage, CHUNK).fetch(reqs)] == want
    for a, b in RANGES:
        assert bytes(storage.read_checked(e, CHUNK, a, b)) == data[a:b]
    with pytest.raises(IntegrityError, match=r"f\.bin: range \[0, 20531\) is outside its 20530 bytes"):
        RangeReader(storage, CHUNK).fetch([(e, 0, len(data) + 1)])


def test_ranges_that_meet_are_coalesced(storage: Storage) -> None:
    data = payload(6 * CHUNK)
    e = put(storage, "f.bin", data)
    calls = count_reads(storage)
    cuts = [0, 100, CHUNK + 7, 3 * CHUNK, 3 * CHUNK + 1, 6 * CHUNK]
    reqs = [(e, a, b) for a, b in zip(cuts, cuts[1:])]
    got = RangeReader(storage, CHUNK).read_many(reqs)
    assert [bytes(v) for v in got] == [data[a:b] for a, b in zip(cuts, cuts[1:])]
    assert calls == [(0, 6 * CHUNK)]  # one read for the whole stream of adjacent slices
    calls.clear()
    # random access: sorted, overlapping or touching chunk spans read as one
    scattered = [(e, 5 * CHUNK + 1, 5 * CHUNK + 9), (e, 10, 20), (e, CHUNK - 1, CHUNK + 1)]
    got = RangeReader(storage, CHUNK).gather(scattered, workers=1)
    assert [bytes(v) for v in got] == [data[a:b] for _, a, b in scattered]
    assert sorted(calls) == [(0, 2 * CHUNK), (5 * CHUNK, 6 * CHUNK)]


def test_a_stream_of_ranges_reads_each_byte_once(storage: Storage) -> None:
    """Requests that share a chunk, a batch apart: the boundary chunk is kept, not read again."""
    data = payload(8 * CHUNK)
    e = put(storage, "f.bin", data)
    reader = RangeReader(storage, CHUNK)
    cuts = list(range(10, 8 * CHUNK, 1000)) + [8 * CHUNK]
    out = b""
    for a, b in zip(cuts, cuts[1:]):  # one batch per range: nothing coalesces
        out += bytes(reader.fetch([(e, a, b)])[0])
    assert out == data[10:]
    assert reader.bytes_read == len(data)  # the header's chunk included, each chunk once


def test_a_corrupted_chunk_names_the_file_and_the_bytes(storage: Storage) -> None:
    data = payload(4 * CHUNK)
    e = entry_of("c.bin", data)
    bad = bytearray(data)
    bad[2 * CHUNK + 5] ^= 1
    storage.put("c.bin", bytes(bad))
    want = rf"c\.bin: chunk 2: bytes \[{2 * CHUNK}, {3 * CHUNK}\) fail their CRC32C check"
    reader = RangeReader(storage, CHUNK)
    assert bytes(reader.fetch([(e, 0, 2 * CHUNK)])[0]) == data[:2 * CHUNK]  # intact chunks read
    for read in (lambda: reader.fetch([(e, CHUNK, 3 * CHUNK)]),
                 lambda: RangeReader(storage, CHUNK).gather([(e, 2 * CHUNK + 1, 2 * CHUNK + 2)]),
                 lambda: RangeReader(storage, CHUNK).read_many([(e, 2 * CHUNK, 4 * CHUNK)])):
        with pytest.raises(IntegrityError, match=want):
            read()


def test_mapped_local_files_and_fsspec_reads_give_the_same_bytes(tmp_path: Path) -> None:
    data = payload(7 * CHUNK + 123, seed=3)
    local, mem = Storage(str(tmp_path / "l")), Storage(f"memory://m-{uuid.uuid4().hex}")
    try:
        reqs = {s: [(put(s, "f.bin", data), a, b) for a, b in RANGES] for s in (local, mem)}
        got = {}
        for s in (local, mem):
            reader = RangeReader(s, CHUNK)
            got[s] = [bytes(v) for v in reader.fetch(reqs[s])]
            assert reader.maps == (s is local and local.backend.can_map)
        assert got[local] == got[mem] == [data[a:b] for a, b in RANGES]
    finally:
        mem.rm("", recursive=True)


@pytest.mark.skipif(os.name != "posix", reason="mapping needs POSIX")
def test_mapped_views_are_not_copies(tmp_path: Path) -> None:
    s = Storage(str(tmp_path))
    data = payload(3 * CHUNK)
    e = put(s, "f.bin", data)
    calls = count_reads(s)
    view = RangeReader(s, CHUNK).fetch([(e, 5, 2 * CHUNK)])[0]
    assert isinstance(view, memoryview) and view.readonly and bytes(view) == data[5:2 * CHUNK]
    assert calls == []  # mapped, never read into memory


# ---------------------------------------------------------------------------- read-ahead


def test_read_ahead_keeps_order_and_fetches_one_ahead() -> None:
    started: list[int] = []

    def fetch(i: int) -> int:
        started.append(i)
        return i * i

    out = []
    for i, v in read_ahead(range(5), fetch):
        out.append((i, v))
        assert max(started) <= i + 1  # never more than one fetched ahead of what is in use
    assert out == [(i, i * i) for i in range(5)] and started == list(range(5))
    assert list(read_ahead([], fetch)) == []


def test_read_ahead_raises_the_fetch_error_in_order() -> None:
    def fetch(i: int) -> int:
        if i == 2:
            raise ValueError("boom at 2")
        return i

    got = []
    with pytest.raises(ValueError, match="boom at 2"):
        for i, _ in read_ahead(range(5), fetch):
            got.append(i)
    assert got == [0, 1]
