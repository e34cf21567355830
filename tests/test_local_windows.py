"""Checked reads of local files straight into memory, in windows of whole chunks on several
threads (shardckpt.storage.read_windows): what the local tier's load and every load into CPU
tensors from a local disk read with."""

from __future__ import annotations

import random
import threading

import pytest

from shardckpt.errors import IntegrityError, StorageError
from shardckpt.format.integrity import crc32c
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import local_windows, read_windows

CS = 64


def _file(tmp_path, name: str, size: int, seed: int) -> tuple[str, bytes, FileEntry]:
    data = bytes(random.Random(seed).randrange(256) for _ in range(size))
    path = tmp_path / name
    path.write_bytes(data)
    chunks = tuple(crc32c(data[i:i + CS]) for i in range(0, size, CS))
    return str(path), data, FileEntry(name, "shard", size, 0, crc32c(data), chunks, 0)


def _pieces(ranges):
    targets = [bytearray(b - a) for a, b in ranges]
    return targets, [(a, b, memoryview(t)) for (a, b), t in zip(ranges, targets, strict=True)]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_pieces_cut_at_window_edges_land_whole_in_every_file(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(local_windows, "WINDOW_BYTES", 3 * CS)  # 14 windows, pieces across edges
    p1, d1, e1 = _file(tmp_path, "a", CS * 40 + 5, 1)
    p2, d2, e2 = _file(tmp_path, "b", CS * 7, 2)
    r1 = [(0, 100), (100, 1000), (1000, 1001), (1200, len(d1))]
    r2 = [(70, 71), (130, 400)]
    t1, q1 = _pieces(r1)
    t2, q2 = _pieces(r2)
    read_windows([(p1, "a", e1, q1), (p2, "b", e2, q2)], CS, threads)
    assert [bytes(t) for t in t1] == [d1[a:b] for a, b in r1]
    assert [bytes(t) for t in t2] == [d2[a:b] for a, b in r2]


def test_windows_hold_whole_chunks_each_read_once():
    step = local_windows.WINDOW_BYTES
    view = memoryview(bytearray(3 * step))
    windows = local_windows.cut([(5, 2 * step + 7, view[:2 * step + 2])], CS)
    assert [[(a, b) for a, b, _ in w] for w in windows] == [
        [(5, step)], [(step, 2 * step)], [(2 * step, 2 * step + 7)]]
    assert sum(len(v) for w in windows for _, _, v in w) == 2 * step + 2


def test_a_damaged_chunk_no_piece_wants_fails_the_read_naming_file_and_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(local_windows, "WINDOW_BYTES", 3 * CS)
    path, data, entry = _file(tmp_path, "a", CS * 40 + 5, 1)
    bad = bytearray(data)
    bad[CS * 31 + 3] ^= 1  # chunk 31 (window 10), in bytes that no piece wants
    with open(path, "wb") as f:
        f.write(bytes(bad))
    _, pieces = _pieces([(0, 1900), (2000, len(data))])
    with pytest.raises(IntegrityError, match=r"^a: chunk 31: bytes \[1984, 2048\) fail their CRC32C"):
        read_windows([(path, "a", entry, pieces)], CS, 4)


def test_a_truncated_file_is_refused_before_it_is_read(tmp_path):
    path, data, entry = _file(tmp_path, "a", CS * 10, 1)
    with open(path, "wb") as f:
        f.write(data[:-1])
    _, pieces = _pieces([(0, 64)])
    with pytest.raises(IntegrityError, match="a: 639 bytes, the manifest records 640"):
        read_windows([(path, "a", entry, pieces)], CS, 2)


def test_a_window_whose_thread_fails_ends_the_read_in_that_error_not_a_hang(tmp_path, monkeypatch):
    """The failure of one window's thread is raised once the windows already started end."""
    monkeypatch.setattr(local_windows, "WINDOW_BYTES", CS)
    path, data, entry = _file(tmp_path, "a", CS * 200, 1)
    real, started, lock = local_windows.read_local_into, [], threading.Lock()

    def flaky(p, url, e, cs, pieces):
        with lock:
            started.append(pieces[0][0])
        if pieces[0][0] == 2 * CS:
            raise StorageError(f"{url}: the disk went away")
        real(p, url, e, cs, pieces)

    monkeypatch.setattr(local_windows, "read_local_into", flaky)
    _, pieces = _pieces([(0, len(data))])
    with pytest.raises(StorageError, match="a: the disk went away"):
        read_windows([(path, "a", entry, pieces)], CS, 2)
    assert 2 * CS in started
