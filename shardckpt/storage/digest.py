"""Per-chunk digests (SHA-256 or BLAKE3) as bytes go by, and the digest of a stored file (:mod:`shardckpt.format.digests`).

:class:`ChunkHasher` is fed the bytes of a file in order (the :class:`~shardckpt.storage.writer.
StreamWriter` calls it where it computes the per-chunk CRC32C, on the same thread, so the bytes pass
once); a writer that places chunks itself calls :meth:`ChunkHasher.chunk` per whole chunk, from any
thread, and :meth:`ChunkHasher.hexdigest` once all are in. ``hashlib`` releases the GIL while it
hashes a buffer of more than 2 KiB, and ``blake3`` while it hashes a large one too.
"""

from __future__ import annotations

import threading
from typing import Any

from shardckpt.format.digests import SHA256, combine, new_hash


class ChunkHasher:
    """The ``algorithm`` digest of each ``chunk_size`` chunk of one file; :meth:`hexdigest`
    combines them."""

    def __init__(self, chunk_size: int, algorithm: str = SHA256) -> None:
        self.chunk_size, self.algorithm = chunk_size, algorithm
        self._digests: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._h: Any = None
        self._fill = 0
        self._index = 0

    def update(self, view: memoryview) -> None:
        """The next bytes of the file, in order."""
        n, pos = len(view), 0
        while pos < n:
            take = min(n - pos, self.chunk_size - self._fill)
            if self._h is None:
                self._h = new_hash(self.algorithm)
            self._h.update(view[pos:pos + take])
            self._fill += take
            pos += take
            if self._fill == self.chunk_size:
                self._finish_chunk()

    def _finish_chunk(self) -> None:
        self.chunk(self._index, self._h.digest())
        self._index, self._h, self._fill = self._index + 1, None, 0

    def chunk(self, index: int, digest: bytes) -> None:
        """The raw digest of chunk ``index`` (any order, any thread)."""
        with self._lock:
            self._digests[index] = digest

    def hexdigest(self) -> str:
        """The file's digest; call once every chunk is in (a short last chunk is closed here)."""
        if self._fill:
            self._finish_chunk()
        n = len(self._digests)
        missing = [i for i in range(n) if i not in self._digests]
        if missing:
            raise ValueError(f"chunk digests missing for chunks {missing[:5]}")
        return combine((self._digests[i] for i in range(n)), self.algorithm)


def hash_chunks(chunks: Any, chunk_size: int, algorithm: str = SHA256) -> str:
    """The ``algorithm`` digest of a file given as an iterable of its bytes in order (e.g.
    :func:`shardckpt.storage.core.iter_file_chunks`)."""
    h = ChunkHasher(chunk_size, algorithm)
    for data in chunks:
        h.update(memoryview(data).cast("B"))
    return h.hexdigest()
