"""Write one local file with positioned writes from several threads and descriptors, each chunk's
CRC32C taken on the way: the parallel save of a shard file.

The file's bytes are given as *parts* in file order: host bytes (anything with a buffer: the
header, the memory of CPU tensors, written straight from there) or :class:`Staged` bytes that
live elsewhere (a device) and are copied into a ring buffer first
(:class:`~shardckpt.storage.pipeline.Ring`, pinned by the caller where that helps). The file is
cut into windows of whole chunks (one ring buffer at most); ``threads`` workers each take the
next window, stage what needs staging, take the CRC32C of its chunks (the extension releases the
GIL) and ``pwritev`` it on a descriptor of their own, then start its writeback
(``sync_file_range``). So device-to-host copies, checksums and writes of different windows run
at once. Once all are written the file is fsynced; the whole-file CRC32C is derived from the
chunks' (:func:`~shardckpt.storage.writer.crc32c_of_chunks`).

Nothing is visible as a checkpoint until its manifest is created (as for every streamed file).
Any failure (``ENOSPC`` in the middle, a part that cannot be staged, a dying worker) stops every
worker, removes the file, and raises; the caller's save then commits nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shardckpt.format.integrity import crc32c
from shardckpt.format.digests import new_hash
from shardckpt.storage.digest import ChunkHasher
from shardckpt.storage.pipeline import IOConfig, Ring, Slot, run_workers
from shardckpt.storage.retry import mapped_errors
from shardckpt.storage.writer import crc32c_of_chunks, start_writeback

IOV_MAX = 512


class Staged:
    """Bytes that must be copied to host memory before they are written (subclassed where
    they live: a device tensor)."""

    nbytes: int = 0

    def stage(self, a: int, b: int, slot: Slot, lo: int) -> None:
        """Copy bytes ``[a, b)`` into ``slot.view[lo:lo + b - a]``; done when this returns."""
        raise NotImplementedError


Part = Any  # a buffer (bytes, memoryview, numpy array) or a Staged


def _size(part: Part) -> int:
    return part.nbytes if isinstance(part, Staged) else memoryview(part).nbytes


def plan(parts: Sequence[Part], chunk_size: int, per_window: int
         ) -> tuple[int, list[tuple[int, int, list[tuple[int, int, int]]]]]:
    """(file size, windows): each window ``(w0, w1, segments)`` of at most ``per_window`` chunks,
    each segment ``(part index, start, end)`` within that part, in file order. Pure."""
    sizes = [_size(p) for p in parts]
    size = sum(sizes)
    step = per_window * chunk_size
    out: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    i, at = 0, 0  # part index, its first byte's file offset
    for w0 in range(0, size, step):
        w1 = min(size, w0 + step)
        segs = []
        while i < len(parts) and at < w1:
            a, b = max(w0, at) - at, min(w1, at + sizes[i]) - at
            if b > a:
                segs.append((i, a, b))
            if at + sizes[i] <= w1:
                at += sizes[i]
                i += 1
            else:
                break
        out.append((w0, w1, segs))
    return size, out


class _Fds:
    """One write descriptor per worker thread, all closed at the end."""

    def __init__(self, path: str, first: int) -> None:
        self.path, self.all, self.local = path, [first], threading.local()
        self.lock = threading.Lock()
        self.local.fd = first

    def get(self) -> int:
        fd = getattr(self.local, "fd", None)
        if fd is None:
            # the same open file, not a second lookup of its path (which a link could redirect)
            fd = self.local.fd = os.open(f"/proc/self/fd/{self.all[0]}", os.O_WRONLY | os.O_CLOEXEC)
            with self.lock:
                self.all.append(fd)
        return fd

    def close(self) -> None:
        for fd in self.all:
            os.close(fd)


def _pwrite_all(fd: int, views: list[memoryview], pos: int) -> None:
    for k in range(0, len(views), IOV_MAX):
        group = [v for v in views[k:k + IOV_MAX] if len(v)]
        while group:
            n = os.pwritev(fd, group, pos)
            pos += n
            while group and n >= len(group[0]):
                n -= len(group[0])
                group.pop(0)
            if group and n:
                group[0] = group[0][n:]


def write_positioned(path: str, url: str, parts: Sequence[Part], chunk_size: int,
                     config: IOConfig, ring: Ring | None = None,
                     open_fd: Callable[[], int] | None = None,
                     hasher: ChunkHasher | None = None) -> tuple[int, int, tuple[int, ...]]:
    """Write ``parts`` (in order) to ``path`` (created or truncated, or a file ``open_fd`` took
    over, cut to the written size) in parallel; fsync it.
    Returns (size, CRC32C, per-chunk CRC32Cs). ``ring`` stages :class:`Staged` parts (required
    where there are any). ``open_fd`` opens ``path`` as its storage does
    (:meth:`~shardckpt.storage.Storage.write_opener`: a private directory's mode, no link
    followed); without it, a plain create-or-truncate. ``hasher`` also takes each chunk's SHA-256,
    computed where its CRC32C is (:mod:`shardckpt.storage.digest`)."""
    views = [None if isinstance(p, Staged) else memoryview(p).cast("B") for p in parts]
    per = (ring.nbytes if ring is not None else config.slot_bytes(chunk_size)) // chunk_size
    size, windows = plan(parts, chunk_size, max(1, per))
    crcs = [0] * (-(-size // chunk_size))
    with mapped_errors("write", url):
        if open_fd is None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            first = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        else:
            first = open_fd()
        fds = _Fds(path, first)

    def one(win: tuple[int, int, list[tuple[int, int, int]]], abort: threading.Event) -> None:
        w0, w1, segs = win
        slot = None
        try:
            if any(views[i] is None for i, _, _ in segs):
                assert ring is not None, "staged parts need a ring"
                slot = ring.acquire(abort)
                lo = 0
                for i, a, b in segs:
                    v = views[i]
                    if v is None:
                        parts[i].stage(a, b, slot, lo)
                    else:
                        slot.view[lo:lo + b - a] = v[a:b]
                    lo += b - a
                out = [slot.view[:w1 - w0]]
            else:
                out = [views[i][a:b] for i, a, b in segs]  # type: ignore[index]
            _checksum(out, w0, chunk_size, crcs, hasher)
            fd = fds.get()
            _pwrite_all(fd, out, w0)
            start_writeback(fd, w0, w1 - w0)
        finally:
            if slot is not None:
                ring.release(slot)  # type: ignore[union-attr]

    try:
        with mapped_errors("write", url):
            run_workers(windows, one, min(config.threads, max(1, len(windows))), "write")
            if os.fstat(fds.all[0]).st_size != size:  # a spare taken over was longer
                os.ftruncate(fds.all[0], size)
            os.fsync(fds.all[0])
    except BaseException:
        fds.close()
        os.unlink(path)
        raise
    with mapped_errors("close", url):
        fds.close()
    return size, crc32c_of_chunks(crcs, chunk_size, size), tuple(crcs)


def _checksum(views: list[memoryview], w0: int, cs: int, crcs: list[int],
              hasher: ChunkHasher | None = None) -> None:
    """The CRC32C of each chunk of a window (``views``, consecutive bytes from ``w0``, which
    starts a chunk), and its digest into ``hasher`` where given."""
    chunk, crc, fill = w0 // cs, 0, 0
    sha = new_hash(hasher.algorithm) if hasher is not None else None
    for v in views:
        pos = 0
        while pos < len(v):
            take = min(len(v) - pos, cs - fill)
            crc = crc32c(v[pos:pos + take], crc)
            if sha is not None:
                sha.update(v[pos:pos + take])
            fill += take
            pos += take
            if fill == cs:
                crcs[chunk] = crc
                if hasher is not None and sha is not None:
                    hasher.chunk(chunk, sha.digest())
                    sha = new_hash(hasher.algorithm)
                chunk, crc, fill = chunk + 1, 0, 0
    if fill:
        crcs[chunk] = crc
        if hasher is not None and sha is not None:
            hasher.chunk(chunk, sha.digest())
