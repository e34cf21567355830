"""One checked range: whole chunks of a file read (or mapped) and verified against the CRC32C the
manifest records for each. The many-range reader built on it is :mod:`.reads`."""

from __future__ import annotations

import logging
from typing import Any, Protocol
from collections.abc import Sequence

from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage.writer import crc32c

log = logging.getLogger(__name__)


class Files(Protocol):
    """What the read path needs of a :class:`~shardckpt.storage.core.Storage`."""

    backend: Any

    def url_of(self, rel: str) -> str: ...

    def full(self, rel: str) -> str: ...

    def read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes: ...


def read_checked(storage: Files, entry: FileEntry, chunk_size: int, start: int, end: int,
                 prefix: str = "") -> memoryview:
    """Bytes ``[start, end)`` of ``entry`` (at ``prefix + entry.path``), reading whole chunks and
    checking each CRC32C."""
    if not 0 <= start <= end <= entry.size:
        raise IntegrityError(f"{storage.url_of(prefix + entry.path)}: range [{start}, {end}) is "
                             f"outside its {entry.size} bytes")
    if start == end:
        return memoryview(b"")
    c0, c1 = start // chunk_size, -(-end // chunk_size)
    view = read_chunks(storage, entry, chunk_size, c0, c1, prefix)
    a = c0 * chunk_size
    return view[start - a:end - a]


def read_chunks(storage: Files, entry: FileEntry, chunk_size: int, c0: int, c1: int,
                prefix: str = "") -> memoryview:
    """Whole chunks ``[c0, c1)`` of ``entry``, each checked against its recorded CRC32C.

    From the first chunk that fails, the range is read once more (a transfer can be bad where
    the object is not) before an :class:`IntegrityError` names the object and the bytes.
    """
    rel = prefix + entry.path
    a, b = c0 * chunk_size, min(entry.size, c1 * chunk_size)
    view = memoryview(_read_exact(storage, rel, entry, a, b))
    bad = _first_bad_chunk(view, entry, chunk_size, c0, c1)
    if bad is None:
        return view
    i = bad[0]
    log.info("%s: bytes [%d, %d) failed their CRC32C check; reading them again",
             storage.url_of(rel), i * chunk_size, min(entry.size, (i + 1) * chunk_size))
    tail = memoryview(_read_exact(storage, rel, entry, i * chunk_size, b))
    again = _first_bad_chunk(tail, entry, chunk_size, i, c1)
    if again is not None:
        j, got = again
        raise IntegrityError(
            f"{storage.url_of(rel)}: chunk {j}: "
            f"bytes [{j * chunk_size}, {min(entry.size, (j + 1) * chunk_size)}) "
            f"fail their CRC32C check (recorded {entry.chunk_crc32c[j]:08x}, read {got:08x}, "
            "read twice); the file is corrupted")
    joined = bytearray(view[:i * chunk_size - a])
    joined += tail
    return memoryview(joined)


def map_chunks(storage: Files, entry: FileEntry, chunk_size: int, c0: int, c1: int, prefix: str = "",
               checked: bytearray | None = None,
               ranges: Sequence[tuple[int, int]] | None = None) -> tuple[memoryview, int]:
    """Where the backend maps files: chunks ``[c0, c1)`` of ``entry`` mapped read-only (no copy
    into user space), as one view of bytes ``[c0 · chunk_size, min(size, c1 · chunk_size))``, and
    the number of bytes checked by this call.

    The chunks under ``ranges`` (absolute byte ranges inside the span; all of it by default)
    are checked against their CRC32C, except those ``checked`` (a bitmap, one bit per chunk
    of the file) marks as checked already; newly checked ones are marked. Pages are only
    touched where they are read, so memory follows the ranges, not the span. The file's size
    is checked first, so a truncated file is an :class:`IntegrityError`, not a fault on
    access. The mapping lives as long as the returned view (or a slice of it). A chunk that
    fails is read again through :func:`read_chunks`, whose error names the object and bytes.
    """
    import mmap

    rel = prefix + entry.path
    a, b = c0 * chunk_size, min(entry.size, c1 * chunk_size)
    if a >= b:
        return memoryview(b""), 0
    mapped, off = storage.backend.map_range(storage.full(rel), storage.url_of(rel), a, b, entry.size)
    view = memoryview(mapped)[a - off:b - off]
    fresh = 0
    for lo, hi in ranges if ranges is not None else [(a, b)]:
        i0, i1 = lo // chunk_size, -(-hi // chunk_size)
        if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            x = i0 * chunk_size - off
            x -= x % mmap.PAGESIZE
            try:  # a hint (start reading ahead); where refused, pages fault in as read
                mapped.madvise(mmap.MADV_WILLNEED, x, min(entry.size, i1 * chunk_size) - off - x)
            except OSError:
                pass
        for i in range(i0, i1):
            if checked is not None and checked[i >> 3] >> (i & 7) & 1:
                continue
            x = i * chunk_size - a
            if crc32c(view[x:x + chunk_size]) != entry.chunk_crc32c[i]:
                read_chunks(storage, entry, chunk_size, i, i + 1, prefix)  # raises, naming the bytes
                raise IntegrityError(f"{storage.url_of(rel)}: bytes [{i * chunk_size}, "
                                     f"{min(entry.size, (i + 1) * chunk_size)}) changed while "
                                     "being read")
            fresh += min(entry.size, (i + 1) * chunk_size) - i * chunk_size
            if checked is not None:
                checked[i >> 3] |= 1 << (i & 7)
    return view, fresh


def _read_exact(storage: Files, rel: str, entry: FileEntry, a: int, b: int) -> bytes:
    data = storage.read(rel, a, b)
    if len(data) != b - a:
        raise IntegrityError(f"{storage.url_of(rel)}: truncated: bytes [{a}, {b}) returned "
                             f"{len(data)} bytes (the manifest records {entry.size})")
    return data


def _first_bad_chunk(view: memoryview, entry: FileEntry, chunk_size: int, c0: int,
                     c1: int) -> tuple[int, int] | None:
    """(index, CRC read) of the first chunk in ``view`` (chunks ``[c0, c1)``) that fails."""
    for i in range(c0, c1):
        lo = (i - c0) * chunk_size
        got = crc32c(view[lo:lo + chunk_size])
        if got != entry.chunk_crc32c[i]:
            return i, got
    return None


# --------------------------------------------- spans of a file straight into the caller's memory


def spans(size: int, chunk_size: int, c0: int, c1: int, pieces: Sequence[tuple[int, int, memoryview]],
          scratch: memoryview, cap: int | None = None) -> list[tuple[int, memoryview]]:
    """Where each byte of chunks ``[c0, c1)`` of a file of ``size`` bytes goes, in file order:
    ``(file offset, destination)`` spans, each piece's target for its range ((start, end,
    target), non-overlapping, sorted, inside the chunks) and ``scratch`` for the bytes between
    (a chunk at most at a time). With ``cap``, no span is longer than ``cap`` bytes. Pure."""
    cs = chunk_size
    end = min(size, c1 * cs)
    pos = c0 * cs
    out: list[tuple[int, memoryview]] = []

    def gap_to(stop: int) -> None:
        nonlocal pos
        while pos < stop:
            k = min(stop, (pos // cs + 1) * cs) - pos
            if cap is not None:
                k = min(k, cap)
            out.append((pos, scratch[:k]))
            pos += k

    for a, b, target in pieces:
        gap_to(a)
        step = b - a if cap is None else cap
        for x in range(a, b, max(step, 1)):
            out.append((x, target[x - a:min(b, x + step) - a]))
        pos = b
    gap_to(end)
    return out


class ChunkCheck:
    """The running CRC32C of a file's chunks as their bytes arrive in order (from chunk ``c0``),
    each compared with ``entry``'s record once whole: :meth:`feed` raises
    :class:`IntegrityError` naming ``url`` and the bytes of the first chunk that fails."""

    def __init__(self, entry: FileEntry, chunk_size: int, url: str, c0: int = 0) -> None:
        self.entry, self.cs, self.url = entry, chunk_size, url
        self.chunk, self.crc = c0, 0

    def feed(self, off: int, view: memoryview) -> None:
        """Bytes ``[off, off + len(view))`` of the file, right after the ones fed before."""
        cs, size = self.cs, self.entry.size
        at = 0
        while at < len(view):  # the running CRC of each chunk, closed at its boundary
            stop = min(len(view) - at, (self.chunk + 1) * cs - (off + at))
            self.crc = crc32c(view[at:at + stop], self.crc)
            at += stop
            if off + at == min(size, (self.chunk + 1) * cs):
                i = self.chunk
                if self.crc != self.entry.chunk_crc32c[i]:
                    raise IntegrityError(
                        f"{self.url}: chunk {i}: bytes [{i * cs}, {min(size, (i + 1) * cs)}) "
                        f"fail their CRC32C check (recorded {self.entry.chunk_crc32c[i]:08x}, read "
                        f"{self.crc:08x}); the file is corrupted")
                self.chunk, self.crc = i + 1, 0
