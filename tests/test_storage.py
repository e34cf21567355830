"""Storage over fsspec on tmp dirs and ``memory://``: checksums, checked ranged reads, commit, errors."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path
from typing import Any, Callable

import crc32c as crc32c_pkg
import numpy as np
import pytest

from shardckpt.errors import (
    CommitConflictError, IntegrityError, ShardckptError, StorageError,
)
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import NotFoundError, RangeReader, RetryPolicy, Storage, iter_file_chunks
from shardckpt.storage.local import LocalBackend

CHUNK = 4096


def crc(data: bytes) -> int:
    """Independent CRC32C (Castagnoli) from the crc32c package, not through shardckpt."""
    return crc32c_pkg.crc32c(data)


def test_crc32c_is_castagnoli() -> None:
    assert crc(b"123456789") == 0xE3069283          # the standard CRC-32C check value
    assert crc(b"") == 0
    assert crc32c_pkg.crc32c(b"56789", crc32c_pkg.crc32c(b"1234")) == 0xE3069283  # streaming


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        yield Storage(str(tmp_path / "root"))
        return
    url = f"memory://test-{uuid.uuid4().hex}"
    yield Storage(url)
    Storage(url).rm("", recursive=True)


def write(storage: Storage, rel: str, data: bytes, pieces: list[int] | None = None,
          chunk: int = CHUNK) -> FileEntry:
    with storage.writer(rel, chunk) as w:
        pos = 0
        for n in pieces or [len(data)]:
            w.write(data[pos:pos + n])
            pos += n
        w.write(data[pos:])
        size, whole, chunks = w.close()
    return FileEntry(rel, "shard", size, 2, whole, chunks, 0)


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def corrupt(storage: Storage, rel: str, pos: int) -> None:
    data = bytearray(storage.read(rel))
    data[pos] ^= 0x01
    storage.put(rel, bytes(data))


def count_reads(storage: Storage) -> list[tuple[int | None, int | None]]:
    """Record every raw ranged read (start, end) this Storage makes, whatever the backend."""
    calls: list[tuple[int | None, int | None]] = []
    real = storage.read

    def read(rel: str, start: int | None = None, end: int | None = None) -> bytes:
        data = real(rel, start, end)
        calls.append((start, end))
        return data
    storage.read = read  # type: ignore[method-assign]
    return calls


# ---------------------------------------------------------------------------------- writer


@pytest.mark.parametrize("n,pieces", [(0, None), (1, None), (CHUNK, None), (CHUNK + 1, None),
                                      (5 * CHUNK + 17, [1, 4095, 4097, 3, 8192]), (3 * CHUNK, [CHUNK] * 3)])
def test_writer_checksums(storage: Storage, n: int, pieces: list[int] | None) -> None:
    data = payload(n)
    e = write(storage, "d/f.bin", data, pieces)
    assert e.size == n and storage.read("d/f.bin") == data and storage.size("d/f.bin") == n
    assert e.crc32c == crc(data)
    want = [crc(data[i:i + CHUNK]) for i in range(0, n, CHUNK)]
    assert list(e.chunk_crc32c) == want and len(want) == -(-n // CHUNK)


def test_writer_checksums_large_writes_and_writeback(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes of 1 MiB and more are checksummed on another thread while the file is written; the
    chunk CRCs are the same. Locally, writeback of each 8 MiB written is started as it goes
    (``sync_file_range``), over contiguous ranges from byte 0, and the file is still whole."""
    from shardckpt.storage import writer as writer_mod

    kicks: list[tuple[int, int, int]] = []
    real = writer_mod._SYNC_FILE_RANGE

    def record(fd: int, off: int, n: int, flags: int) -> int:
        kicks.append((off, n, flags))
        return real(fd, off, n, flags) if real is not None else 0
    monkeypatch.setattr(writer_mod, "_SYNC_FILE_RANGE", record)
    storage = Storage(str(tmp_path))
    big = 1 << 20
    data = payload(20 * big + 5)
    pieces = [3 * big + 7, 1, big, 9 * big, 2 * big - 8, 5 * big + 5]
    assert sum(pieces) == len(data)
    e = write(storage, "big.bin", data, pieces, chunk=big)
    assert e.crc32c == crc(data) and storage.read("big.bin") == data
    assert list(e.chunk_crc32c) == [crc(data[i:i + big]) for i in range(0, len(data), big)]
    assert kicks and kicks[0][0] == 0 and all(f == 2 for _, _, f in kicks)
    assert all(a + n == b for (a, n, _), (b, _, _) in zip(kicks, kicks[1:]))
    assert all(n >= writer_mod.WRITEBACK_BYTES for _, n, _ in kicks)


def test_writer_accepts_numpy_and_memoryview(storage: Storage) -> None:
    arr = np.arange(3000, dtype=np.float32)
    with storage.writer("a.bin", CHUNK) as w:
        w.write(arr)
        w.write(memoryview(b"tail"))
        size, whole, _ = w.close()
    assert storage.read("a.bin") == arr.tobytes() + b"tail" and whole == crc(arr.tobytes() + b"tail")
    assert size == 12004


def test_aborted_writer_leaves_nothing(storage: Storage) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with storage.writer("d/partial.bin", CHUNK) as w:
            w.write(payload(3 * CHUNK))
            raise RuntimeError("boom")
    assert not storage.exists("d/partial.bin")
    assert "partial.bin" not in storage.ls("d")
    if isinstance(storage.backend, LocalBackend):  # no temporary either
        assert not any("partial" in p.name for p in Path(storage.full("d")).iterdir())


# ----------------------------------------------------------------------------- checked reads


def test_read_checked_returns_the_range_and_reads_only_covering_chunks(storage: Storage) -> None:
    data = payload(10 * CHUNK + 100)
    e = write(storage, "f.bin", data)
    calls = count_reads(storage)
    for a, b in [(0, 1), (5, CHUNK), (CHUNK - 1, CHUNK + 1), (3 * CHUNK, 3 * CHUNK),
                 (7 * CHUNK + 5, 10 * CHUNK + 100), (0, len(data)), (10 * CHUNK, 10 * CHUNK + 3)]:
        calls.clear()
        got = storage.read_checked(e, CHUNK, a, b)
        assert bytes(got) == data[a:b]
        if a == b:
            assert calls == []
        else:
            lo, hi = a // CHUNK * CHUNK, min(len(data), -(-b // CHUNK) * CHUNK)
            assert calls == [(lo, hi)], (a, b)


def test_read_checked_refuses_out_of_range(storage: Storage) -> None:
    e = write(storage, "f.bin", payload(100))
    with pytest.raises(IntegrityError, match=r"range \[90, 101\) is outside its 100 bytes"):
        storage.read_checked(e, CHUNK, 90, 101)


def test_memory_backend_reads_ranges_not_files() -> None:
    s = Storage(f"memory://t-{uuid.uuid4().hex}")
    data = payload(8 * CHUNK)
    e = write(s, "f.bin", data)
    seen: list[tuple[Any, Any]] = []
    real = s.fs.cat_file

    def cat_file(path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        seen.append((start, end))
        return real(path, start=start, end=end, **kw)
    s.fs.cat_file = cat_file  # type: ignore[method-assign]
    try:
        assert bytes(s.read_checked(e, CHUNK, 2 * CHUNK + 10, 2 * CHUNK + 20)) == data[2 * CHUNK + 10:2 * CHUNK + 20]
        assert seen == [(2 * CHUNK, 3 * CHUNK)]
    finally:
        del s.fs.cat_file
        s.rm("", recursive=True)


def test_flipped_byte_caught_and_named(storage: Storage) -> None:
    data = payload(6 * CHUNK + 10)
    e = write(storage, "sub/f.bin", data)
    pos = 4 * CHUNK + 123
    corrupt(storage, "sub/f.bin", pos)
    with pytest.raises(IntegrityError) as ei:
        storage.read_checked(e, CHUNK, pos, pos + 1)
    msg = str(ei.value)
    assert storage.url_of("sub/f.bin") in msg
    assert f"bytes [{4 * CHUNK}, {5 * CHUNK})" in msg and "CRC32C" in msg and "corrupted" in msg
    # ranges whose chunks do not hold the flipped byte still read fine
    assert bytes(storage.read_checked(e, CHUNK, 0, 4 * CHUNK)) == data[:4 * CHUNK]
    assert bytes(storage.read_checked(e, CHUNK, 5 * CHUNK, len(data))) == data[5 * CHUNK:]
    # a range that merely touches the bad chunk is refused too (the whole chunk is checked)
    with pytest.raises(IntegrityError):
        storage.read_checked(e, CHUNK, 4 * CHUNK - 1, 4 * CHUNK + 1)


def test_flipped_byte_in_last_partial_chunk(storage: Storage) -> None:
    data = payload(2 * CHUNK + 10)
    e = write(storage, "f.bin", data)
    corrupt(storage, "f.bin", 2 * CHUNK + 9)
    with pytest.raises(IntegrityError, match=rf"bytes \[{2 * CHUNK}, {2 * CHUNK + 10}\)"):
        storage.read_checked(e, CHUNK, 2 * CHUNK, 2 * CHUNK + 1)


def test_truncated_file_detected(storage: Storage) -> None:
    data = payload(3 * CHUNK + 50)
    e = write(storage, "f.bin", data)
    storage.put("f.bin", data[:3 * CHUNK + 20])
    with pytest.raises(IntegrityError, match=r"truncated.*records 12338"):
        storage.read_checked(e, CHUNK, 3 * CHUNK, 3 * CHUNK + 1)
    assert bytes(storage.read_checked(e, CHUNK, 0, CHUNK)) == data[:CHUNK]  # earlier chunks intact
    storage.put("f.bin", data[:CHUNK])
    with pytest.raises(IntegrityError, match="truncated"):
        storage.read_checked(e, CHUNK, CHUNK + 5, CHUNK + 6)


def test_gather_coalesces_and_checks(storage: Storage) -> None:
    a_data, b_data = payload(8 * CHUNK, 1), payload(3 * CHUNK, 2)
    a, b = write(storage, "a.bin", a_data), write(storage, "b.bin", b_data)
    calls = count_reads(storage)
    reqs = [(a, 10, 20), (a, 100, CHUNK + 5), (b, 0, 7), (a, CHUNK + 6, 2 * CHUNK),   # a: chunks 0-1
            (a, 6 * CHUNK + 1, 6 * CHUNK + 2), (a, 5 * CHUNK, 5 * CHUNK + 1),        # a: chunks 5-6
            (b, 2 * CHUNK, 3 * CHUNK)]                                              # b: 0 and 2
    out = RangeReader(storage, CHUNK).gather(reqs, workers=4)
    for (e, s, t), got in zip(reqs, out):
        src = a_data if e is a else b_data
        assert bytes(got) == src[s:t]
    assert sorted(calls) == sorted([(0, 2 * CHUNK), (5 * CHUNK, 7 * CHUNK), (0, CHUNK), (2 * CHUNK, 3 * CHUNK)])
    # sequential path gives the same answer
    assert [bytes(x) for x in RangeReader(storage, CHUNK).gather(reqs, workers=1)] == [bytes(x) for x in out]
    corrupt(storage, "a.bin", 5 * CHUNK + 3000)
    with pytest.raises(IntegrityError, match=r"a\.bin: chunk 5: bytes \[20480, 24576\)"):
        RangeReader(storage, CHUNK).gather(reqs, workers=4)


# --------------------------------------------------------------------------------- commit


def test_create_only_twice_conflicts_and_keeps_the_first(storage: Storage) -> None:
    storage.create_only("manifest.json", b"first")
    with pytest.raises(CommitConflictError) as ei:
        storage.create_only("manifest.json", b"second")
    assert storage.url_of("manifest.json") in str(ei.value) and "already exists" in str(ei.value)
    assert isinstance(ei.value, StorageError)
    assert storage.read("manifest.json") == b"first"
    if isinstance(storage.backend, LocalBackend):  # the temporary was removed
        assert sorted(p.name for p in Path(storage.root).iterdir()) == ["manifest.json"]


def test_create_only_local_never_half_written(tmp_path: Path) -> None:
    s = Storage(str(tmp_path))
    s.create_only("x/manifest.json", b"{}" * 1000)
    assert (tmp_path / "x" / "manifest.json").read_bytes() == b"{}" * 1000
    assert os.stat(tmp_path / "x" / "manifest.json").st_nlink == 1  # the temporary is gone


def test_put_replaces(storage: Storage) -> None:
    storage.put("latest", b"a")
    storage.put("latest", b"bb")
    assert storage.read("latest") == b"bb"


def test_list_sizes_is_fresh_and_lists_files_only(storage: Storage) -> None:
    assert storage.list_sizes("d") == {}
    storage.put("d/a", b"xyz")
    storage.put("d/sub/b", b"q")
    assert storage.list_sizes("d") == {"a": 3}
    storage.put("d/a", b"xy")  # a cached listing would still say 3
    storage.rm("d/sub", recursive=True)
    storage.put("d/c", b"")
    assert storage.list_sizes("d") == {"a": 2, "c": 0}


def test_locations_compare_places_not_spellings(tmp_path: Path) -> None:
    from shardckpt.storage.places import contains

    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "src")
    src = Storage(str(tmp_path / "src")).location()
    for spelling in (f"{tmp_path}/src/.", f"{tmp_path}/link", f"{tmp_path}/nowhere/../src",
                     f"file://{tmp_path}/src/"):
        assert Storage(spelling).location() == src, spelling
    sub = Storage(f"{tmp_path}/link/sub").location()
    assert contains(src, sub) and not contains(sub, src)
    assert not contains(src, Storage(f"{tmp_path}/src2").location())  # a prefix of the name only
    a, b = Storage("memory://bucket/x/./y"), Storage("memory://bucket/x//y/")
    assert a.location() == b.location() and contains(Storage("memory://bucket/x").location(), a.location())
    assert not contains(src, a.location())


def test_ensure_free_space_names_figures_and_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from shardckpt.errors import InsufficientSpaceError

    probed = []

    def statvfs(path: str) -> Any:
        probed.append(path)
        return SimpleNamespace(f_bavail=10, f_frsize=4096)
    monkeypatch.setattr(os, "statvfs", statvfs)
    s = Storage(str(tmp_path / "a" / "b"))
    s.ensure_free_space("c", 40960, "test")  # exactly what is free
    with pytest.raises(InsufficientSpaceError, match=r"test: .*a/b/c needs 40961 bytes .* has 40960 bytes"):
        s.ensure_free_space("c", 40961, "test")
    assert probed == [str(tmp_path)] * 2  # the nearest directory that exists
    assert not (tmp_path / "a").exists()


# --------------------------------------------------------------------------------- errors


def test_missing_file_maps_to_not_found(storage: Storage) -> None:
    with pytest.raises(NotFoundError) as ei:
        storage.read("nope/x.bin")
    assert isinstance(ei.value, StorageError) and isinstance(ei.value, ShardckptError)
    assert isinstance(ei.value.__cause__, FileNotFoundError)
    assert storage.url_of("nope/x.bin") in str(ei.value) and ei.value.path == storage.url_of("nope/x.bin")
    with pytest.raises(NotFoundError):
        storage.size("nope/x.bin")
    with pytest.raises(NotFoundError):
        list(iter_file_chunks(storage, "nope/x.bin", CHUNK))
    assert storage.ls("nope") == []


def test_directory_read_maps_to_storage_error(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    s = Storage(str(tmp_path))
    with pytest.raises(StorageError) as ei:
        s.read("d")
    assert isinstance(ei.value.__cause__, IsADirectoryError) and "d" in str(ei.value)
    with pytest.raises(StorageError, match="is a directory"):
        s.size("d")


def test_writes_under_a_file_map_to_storage_error(tmp_path: Path) -> None:
    """A path component that is a file: open, commit and put all fail as StorageError, cause kept."""
    (tmp_path / "f").write_bytes(b"x")
    s = Storage(str(tmp_path))
    for what, fn in [("open", lambda: s.writer("f/child.bin", CHUNK)),
                     ("commit", lambda: s.create_only("f/manifest.json", b"{}")),
                     ("write", lambda: s.put("f/latest", b"x"))]:
        with pytest.raises(StorageError) as ei:
            fn()
        assert not isinstance(ei.value, CommitConflictError)
        assert isinstance(ei.value.__cause__, OSError), what
        assert f"{tmp_path}/f/" in str(ei.value) and what in str(ei.value)
    assert (tmp_path / "f").read_bytes() == b"x"


def _flaky(failures: list[BaseException], result: Any) -> Callable[[], Any]:
    def fn() -> Any:
        if failures:
            raise failures.pop(0)
        return result
    return fn


def test_retries_transient_errors_then_maps_the_last(tmp_path: Path) -> None:
    s = Storage(str(tmp_path), retry=RetryPolicy(deadline_s=5, initial_backoff_s=0.001, max_backoff_s=0.002))
    errs: list[BaseException] = [ConnectionResetError("reset"), OSError(errno.ETIMEDOUT, "t"), TimeoutError()]
    assert s.call("read", "x", _flaky(errs, 42)) == 42 and errs == []
    # not retryable: raised at once, mapped, original kept
    perm: list[BaseException] = [PermissionError(errno.EACCES, "denied"), ValueError("never reached")]
    with pytest.raises(StorageError, match="permission denied") as ei:
        s.call("read", "x", _flaky(perm, 1))
    assert isinstance(ei.value.__cause__, PermissionError) and len(perm) == 1
    # retryable until the deadline, then mapped with the cause
    s2 = Storage(str(tmp_path), retry=RetryPolicy(deadline_s=0.05, initial_backoff_s=0.01, max_backoff_s=0.01))
    with pytest.raises(StorageError, match="ConnectionResetError") as ei:
        s2.call("read", "x", _flaky([ConnectionResetError("r")] * 1000, 1))
    assert isinstance(ei.value.__cause__, ConnectionResetError)


# ---------------------------------------------------------------------------------- URLs


def test_urls(tmp_path: Path) -> None:
    plain = Storage(str(tmp_path / "a"))
    plain.put("x/y.bin", b"plain")
    file_url = Storage(f"file://{tmp_path}/a/")
    assert isinstance(file_url.backend, LocalBackend) and isinstance(plain.backend, LocalBackend)
    assert file_url.read("x/y.bin") == b"plain"
    assert file_url.url == f"file://{tmp_path}/a" and plain.url_of("x/y.bin") == f"{tmp_path}/a/x/y.bin"
    assert plain.child("x").read("y.bin") == b"plain" and plain.child("x").url == f"{tmp_path}/a/x"
    mem_url = f"memory://u-{uuid.uuid4().hex}/ckpt"
    mem = Storage(mem_url)
    assert not isinstance(mem.backend, LocalBackend)
    mem.put("x/y.bin", b"mem")
    assert Storage(mem_url + "/").read("x/y.bin") == b"mem"
    assert mem.url_of("x/y.bin") == f"{mem_url}/x/y.bin"
    assert mem.ls("") == ["x"] and mem.ls("x") == ["y.bin"] and mem.isdir("x")
    mem.rm("", recursive=True)
    assert not mem.exists("x/y.bin")


def test_bad_url_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match="cannot open this location"):
        Storage("nosuchprotocol-xyz://bucket/x")


def test_read_limited(storage: Storage) -> None:
    storage.put("m.json", b"x" * 100)
    assert storage.read_limited("m.json", 100) == b"x" * 100
    with pytest.raises(StorageError, match="100 bytes, more than the 99 allowed"):
        storage.read_limited("m.json", 99)


def test_iter_file_chunks(storage: Storage) -> None:
    data = payload(3 * CHUNK + 5)
    write(storage, "f.bin", data)
    pieces = list(iter_file_chunks(storage, "f.bin", CHUNK))
    assert [len(p) for p in pieces] == [CHUNK, CHUNK, CHUNK, 5] and b"".join(pieces) == data
    assert b"".join(iter_file_chunks(storage, "f.bin", CHUNK, limit=CHUNK + 1)) == data[:CHUNK + 1]


# ------------------------------------------------------------------------- mapped local reads


def test_map_many_views_checks_each_chunk_once(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    data = payload(5 * CHUNK + 100)
    e = write(storage, "m.bin", data)
    reader = RangeReader(storage, CHUNK)
    ranges = [(0, 10), (10, CHUNK + 5), (CHUNK + 5, 3 * CHUNK), (2 * CHUNK - 1, 2 * CHUNK + 1),
              (4 * CHUNK + 7, len(data)), (7, 7)]
    views = reader.map_many([(e, a, b) for a, b in ranges])
    assert [bytes(v) for v in views] == [data[a:b] for a, b in ranges]
    # chunks 0..2 and 4..5 were each checked once, chunk 3 never
    assert reader.bytes_read == 3 * CHUNK + CHUNK + 100
    assert bytes(reader.map_many([(e, 0, len(data))])[0]) == data
    assert reader.bytes_read == len(data)
    with pytest.raises(IntegrityError, match="outside"):
        reader.map_many([(e, 0, len(data) + 1)])


def test_map_many_refuses_truncated_and_corrupted(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    data = payload(3 * CHUNK)
    e = write(storage, "t.bin", data)
    path = tmp_path / "t.bin"
    path.write_bytes(data[:-1])
    with pytest.raises(IntegrityError, match=rf"t\.bin: {3 * CHUNK - 1} bytes.*truncated"):
        RangeReader(storage, CHUNK).map_many([(e, 0, 10)])
    bad = bytearray(data)
    bad[CHUNK + 3] ^= 1
    path.write_bytes(bytes(bad))
    reader = RangeReader(storage, CHUNK)
    assert bytes(reader.map_many([(e, 0, CHUNK)])[0]) == data[:CHUNK]  # chunk 0 is fine
    with pytest.raises(IntegrityError, match=rf"t\.bin: chunk 1: bytes \[{CHUNK}, {2 * CHUNK}\) fail their CRC32C"):
        reader.map_many([(e, CHUNK - 2, CHUNK + 2)])
