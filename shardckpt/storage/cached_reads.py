"""Checked ranged reads that remember boundary chunks, so a stream of ranges reads each byte once.

A checked read must fetch whole chunks to verify their CRC32C. When two requests meet inside a
chunk (a reshard reads slot after slot, shard after shard, and a target shard may take a few
elements of the chunk its neighbour takes the rest of), the shared chunk would be fetched twice;
this reader keeps partly consumed chunks until the rest of them has been read. Memory: at most
``capacity`` chunks. Local files can instead be mapped (:meth:`CachedRangeReader.map_many`): no
copy at all, and a bitmap remembers which chunks were checked.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import Storage


class CachedRangeReader:
    """``read(entry, start, end)`` like :meth:`Storage.read_checked`, with a boundary-chunk cache.

    A chunk is kept only while partly consumed: when a read covers part of its first or last
    chunk, the chunk is cached with the bytes consumed so far, and dropped once later reads have
    consumed the rest (or, least recently used, when more than ``capacity`` are held). So a
    reshard whose target shards straddle source chunks fetches each source byte about once, even
    when the neighbouring range is read a whole target shard later. Thread-safe.
    ``bytes_read`` counts what was actually fetched from storage.
    """

    def __init__(self, storage: Storage, chunk_size: int, capacity: int = 64, prefix: str = "") -> None:
        self.storage, self.chunk_size, self.capacity, self.prefix = storage, chunk_size, capacity, prefix
        self._cache: OrderedDict[tuple[str, int], tuple[bytes, int]] = OrderedDict()  # data, consumed
        self._lock = threading.Lock()
        self._checked: dict[str, bytearray] = {}  # map_many: a bit per chunk already checked
        self.bytes_read = 0

    def _overlap(self, i: int, start: int, end: int) -> int:
        return max(0, min(end, (i + 1) * self.chunk_size) - max(start, i * self.chunk_size))

    def _used(self, entry: FileEntry, i: int, start: int, end: int) -> int:
        """Bytes of chunk ``i`` consumed once ``[start, end)`` is: the range's part, plus the
        file's header (never requested through this reader, so it must not keep a chunk alive)."""
        return self._overlap(i, start, end) + self._overlap(i, 0, min(entry.data_start, start))

    def _take(self, key: tuple[str, int], start: int, end: int) -> bytes | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            data, used = hit
            used += self._overlap(key[1], start, end)
            if used >= len(data):
                del self._cache[key]  # every byte of it has been consumed
            else:
                self._cache[key] = (data, used)
                self._cache.move_to_end(key)
            return data

    def _put(self, key: tuple[str, int], data: bytes, used: int) -> None:
        with self._lock:
            self._cache[key] = (data, used)
            self._cache.move_to_end(key)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)

    def read(self, entry: FileEntry, start: int, end: int) -> "bytes | memoryview":
        rel = self.prefix + entry.path
        cs = self.chunk_size
        if not 0 <= start <= end <= entry.size:
            raise IntegrityError(f"{self.storage.url_of(rel)}: range [{start}, {end}) is outside "
                                 f"its {entry.size} bytes")
        if start == end:
            return b""
        c0, c1 = start // cs, -(-end // cs)
        chunks: list[bytes | memoryview | None] = [self._take((entry.path, i), start, end)
                                                   for i in range(c0, c1)]
        lo = next((k for k, c in enumerate(chunks) if c is None), None)
        if lo is not None:
            hi = max(k for k, c in enumerate(chunks) if c is None) + 1
            view = self.storage.read_chunks(entry, cs, c0 + lo, c0 + hi, self.prefix)  # CRC-checked
            with self._lock:
                self.bytes_read += len(view)
            for k in range(lo, hi):
                if chunks[k] is None:
                    chunks[k] = view[(k - lo) * cs:(k - lo + 1) * cs]
            for k in {lo, hi - 1}:
                i = c0 + k
                used = self._used(entry, i, start, end)
                if used < min(entry.size, (i + 1) * cs) - i * cs:  # partly consumed: keep it
                    self._put((entry.path, i), bytes(view[(k - lo) * cs:(k - lo + 1) * cs]), used)
            if lo == 0 and hi == len(chunks):  # all fetched in one piece: no copy
                return view[start - c0 * cs:end - c0 * cs]
        if len(chunks) == 1:
            return bytes(memoryview(chunks[0])[start - c0 * cs:end - c0 * cs])  # type: ignore[arg-type]
        joined = b"".join(chunks)  # type: ignore[arg-type]
        return memoryview(joined)[start - c0 * cs:end - c0 * cs]

    @staticmethod
    def _runs(requests: Sequence[tuple[FileEntry, int, int]]) -> "list[list[tuple[FileEntry, int, int, list[int]]]]":
        """Per file (in order of first appearance), runs of consecutive requests that meet (the
        next starts where the previous ended): ``(entry, lo, hi, request indices)``."""
        by_file: dict[str, list[int]] = {}
        for i, (e, _, _) in enumerate(requests):
            by_file.setdefault(e.path, []).append(i)
        out = []
        for indices in by_file.values():
            runs, k = [], 0
            while k < len(indices):
                entry, lo, hi = requests[indices[k]]
                end = k + 1
                while end < len(indices) and requests[indices[end]][1] == hi:
                    hi = requests[indices[end]][2]
                    end += 1
                runs.append((entry, lo, hi, indices[k:end]))
                k = end
            out.append(runs)
        return out

    @staticmethod
    def _per_file(groups: list[Any], run: Any, workers: int) -> None:
        """``run(group)`` for each file's group: files concurrently, each file in order."""
        if len(groups) <= 1 or workers <= 1:
            for g in groups:
                run(g)
        else:
            with ThreadPoolExecutor(min(workers, len(groups))) as pool:
                list(pool.map(run, groups))

    def map_many(self, requests: Sequence[tuple[FileEntry, int, int]]) -> "list[memoryview]":
        """Local storage only (``storage.can_map``): each range as a read-only view of its mapped
        file (no copy; one mapping per file and call), every chunk under a range CRC-checked once
        per reader (a bit per chunk and file remembers which were: memory is one bit per chunk),
        so ranges that share a chunk check it once. Views pin their mapping: drop them when done.
        ``bytes_read`` counts each chunk the first time it is checked. Call it from one thread at
        a time."""
        cs = self.chunk_size
        out: list[memoryview] = [memoryview(b"")] * len(requests)
        by_file: dict[str, list[int]] = {}
        for k, (entry, start, end) in enumerate(requests):
            if not 0 <= start <= end <= entry.size:
                raise IntegrityError(f"{self.storage.url_of(self.prefix + entry.path)}: range "
                                     f"[{start}, {end}) is outside its {entry.size} bytes")
            if start < end:
                by_file.setdefault(entry.path, []).append(k)
        for members in by_file.values():
            entry = requests[members[0]][0]
            ranges = [(requests[k][1], requests[k][2]) for k in members]
            c0 = min(a for a, _ in ranges) // cs
            c1 = -(-max(b for _, b in ranges) // cs)
            checked = self._checked.get(entry.path)
            if checked is None:
                checked = self._checked[entry.path] = bytearray(-(-entry.size // cs) // 8 + 1)
            view, fresh = self.storage.map_chunks(entry, cs, c0, c1, self.prefix, checked, ranges)
            with self._lock:
                self.bytes_read += fresh
            for k, (a, b) in zip(members, ranges):
                out[k] = view[a - c0 * cs:b - c0 * cs]
        return out

    def read_many(self, requests: Sequence[tuple[FileEntry, int, int]],
                  workers: int = 4) -> "list[bytes | memoryview]":
        """Read several ranges; ranges of different files go concurrently, each file in order.

        Consecutive requests of one file that meet (the next starts where the previous ended)
        are coalesced into one read, so a stream of adjacent slices costs one ranged GET.
        """
        out: list[bytes | memoryview] = [b""] * len(requests)

        def run(runs: list[tuple[FileEntry, int, int, list[int]]]) -> None:
            for entry, lo, hi, members in runs:
                view = memoryview(self.read(entry, lo, hi))
                for i in members:
                    _, a, b = requests[i]
                    out[i] = view[a - lo:b - lo]

        self._per_file(self._runs(requests), run, workers)
        return out
