"""Checked ranged reads that remember boundary chunks, so a stream of ranges reads each byte once.

A checked read must fetch whole chunks to verify their CRC32C. When consecutive requests meet
inside a chunk (a reshard reads slot after slot, shard after shard), the shared chunk would be
fetched twice; this reader keeps the first and last chunk of each read in a small LRU cache and
reads only what it does not hold. Memory: at most ``capacity`` chunks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from shardckpt.errors import IntegrityError
from shardckpt.manifest import FileEntry
from shardckpt.storage import Storage, crc32c


class CachedRangeReader:
    """``read(entry, start, end)`` like :meth:`Storage.read_checked`, with a boundary-chunk cache.

    Thread-safe. ``bytes_read`` counts what was actually fetched from storage.
    """

    def __init__(self, storage: Storage, chunk_size: int, capacity: int = 16, prefix: str = "") -> None:
        self.storage, self.chunk_size, self.capacity, self.prefix = storage, chunk_size, capacity, prefix
        self._cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _get(self, key: tuple[str, int]) -> bytes | None:
        with self._lock:
            data = self._cache.get(key)
            if data is not None:
                self._cache.move_to_end(key)
            return data

    def _put(self, key: tuple[str, int], data: bytes) -> None:
        with self._lock:
            self._cache[key] = data
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
        chunks: list[bytes | None] = [self._get((entry.path, i)) for i in range(c0, c1)]
        lo = next((k for k, c in enumerate(chunks) if c is None), None)
        if lo is not None:
            hi = max(k for k, c in enumerate(chunks) if c is None) + 1
            a, b = (c0 + lo) * cs, min(entry.size, (c0 + hi) * cs)
            data = self.storage.read(rel, a, b)
            with self._lock:
                self.bytes_read += len(data)
            if len(data) != b - a:
                raise IntegrityError(f"{self.storage.url_of(rel)}: truncated: bytes [{a}, {b}) "
                                     f"returned {len(data)} bytes (the manifest records {entry.size})")
            view = memoryview(data)
            for k in range(lo, hi):
                i = c0 + k
                piece = view[(k - lo) * cs:(k - lo + 1) * cs]
                got = crc32c(piece)
                if got != entry.chunk_crc32c[i]:
                    raise IntegrityError(
                        f"{self.storage.url_of(rel)}: bytes [{i * cs}, {min(entry.size, (i + 1) * cs)}) "
                        f"fail their CRC32C check (recorded {entry.chunk_crc32c[i]:08x}, read "
                        f"{got:08x}); the file is corrupted")
                if chunks[k] is None:
                    chunks[k] = piece  # type: ignore[assignment]
            for k in {lo, hi - 1}:
                self._put((entry.path, c0 + k), bytes(view[(k - lo) * cs:(k - lo + 1) * cs]))
            if lo == 0 and hi == len(chunks):  # all fetched in one piece: no copy
                return view[start - a:end - a]
        if len(chunks) == 1:
            return bytes(memoryview(chunks[0])[start - c0 * cs:end - c0 * cs])  # type: ignore[arg-type]
        joined = b"".join(chunks)  # type: ignore[arg-type]
        return memoryview(joined)[start - c0 * cs:end - c0 * cs]

    def read_many(self, requests: Sequence[tuple[FileEntry, int, int]],
                  workers: int = 4) -> "list[bytes | memoryview]":
        """Read several ranges; ranges of different files go concurrently, each file in order."""
        by_file: dict[str, list[int]] = {}
        for i, (e, _, _) in enumerate(requests):
            by_file.setdefault(e.path, []).append(i)
        out: list[bytes | memoryview] = [b""] * len(requests)

        def run(indices: list[int]) -> None:
            for i in indices:
                out[i] = self.read(*requests[i])

        groups = list(by_file.values())
        if len(groups) <= 1 or workers <= 1:
            for g in groups:
                run(g)
        else:
            with ThreadPoolExecutor(min(workers, len(groups))) as pool:
                list(pool.map(run, groups))
        return out
