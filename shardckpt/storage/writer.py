"""Streaming writes that checksum as bytes go by and never commit a partial object.

A :class:`StreamWriter` computes the per-chunk CRC32C (and from them the whole-file one) and hands
the bytes to a sink its backend chose: a local file (fsync on close), an S3 multipart upload
(:class:`~shardckpt.storage.s3upload.S3Upload`), or any other fsspec file. A sink is built from its
backend, the object's full path and its URL (for messages).
"""

from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol
from collections.abc import Callable

from shardckpt.errors import StorageError
from shardckpt.format.integrity import crc32c
from shardckpt.storage.digest import ChunkHasher
from shardckpt.storage.retry import describe_error, map_error, mapped_errors

log = logging.getLogger(__name__)


# CRC32C combine, as zlib's crc32_combine: crc(A + B) = x^(8 len(B)) * crc(A) + crc(B) mod P
# (reflected bit order; the pre- and post-inversions cancel out).
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """a * b mod P, both reflected 32-bit polynomials."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p, t = 1 << 30, []  # x^1
    for _ in range(32):
        t.append(p)
        p = _multmodp(p, p)
    return t


_X2N = _x2n_table()  # x^(2^k) mod P


def crc32c_shift(n: int) -> int:
    """The operator x^(8n) mod P: multiplying a CRC by it appends ``n`` zero bytes to its data."""
    p, k = 1 << 31, 3  # x^0; 2^3 bits a byte
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1`` of A, ``crc2`` of B and ``len2 = len(B)``."""
    return _multmodp(crc32c_shift(len2), crc1) ^ crc2


_shift_tables: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}


def _tables(n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The operator of :func:`crc32c_shift` as four 256-entry tables (one per byte of the CRC)."""
    t = _shift_tables.get(n)
    if t is None:
        op = crc32c_shift(n)
        basis = [_multmodp(op, 1 << j) for j in range(32)]

        def table(byte: int) -> list[int]:
            out = [0] * 256
            for v in range(1, 256):
                low = v & -v
                out[v] = out[v ^ low] ^ basis[8 * byte + low.bit_length() - 1]
            return out
        t = (table(0), table(1), table(2), table(3))
        if len(_shift_tables) > 16:
            _shift_tables.clear()
        _shift_tables[n] = t
    return t


def crc32c_of_chunks(chunk_crcs: list[int] | tuple[int, ...], chunk_size: int, size: int) -> int:
    """Whole-data CRC32C from the CRC32Cs of its ``chunk_size`` chunks (the last may be short)."""
    if not chunk_crcs:
        return 0
    t0, t1, t2, t3 = _tables(chunk_size)
    crc = chunk_crcs[0]
    full = len(chunk_crcs) - 1 if size % chunk_size else len(chunk_crcs)
    for c in chunk_crcs[1:full]:
        crc = t0[crc & 0xFF] ^ t1[(crc >> 8) & 0xFF] ^ t2[(crc >> 16) & 0xFF] ^ t3[crc >> 24] ^ c
    if full < len(chunk_crcs) and len(chunk_crcs) > 1:  # the short last chunk: its operator once
        crc = _multmodp(crc32c_shift(size % chunk_size), crc) ^ chunk_crcs[-1]
    return crc


_PARALLEL_CRC_BYTES = 1 << 20
_CRC_POOL: dict[int, ThreadPoolExecutor] = {}


def _crc_pool() -> ThreadPoolExecutor:
    """One thread per process for checksums that overlap a sink's write (CRC32C drops the GIL).

    Keyed by pid: a forked child does not inherit the parent's thread, so it starts its own.
    """
    pid = os.getpid()
    pool = _CRC_POOL.get(pid)
    if pool is None:
        _CRC_POOL.clear()
        pool = _CRC_POOL[pid] = ThreadPoolExecutor(1, thread_name_prefix="shardckpt-crc")
    return pool


class Sink(Protocol):
    """Where a :class:`StreamWriter`'s bytes go: ``write`` them in order, then ``close`` (make the
    object whole and durable) or ``abort`` (nothing becomes visible)."""

    def write(self, view: memoryview) -> None: ...

    def close(self, size: int) -> None: ...

    def abort(self) -> None: ...


class StreamWriter:
    """Sequential writer that computes the whole-file and per-chunk CRC32C as bytes go by.

    Use as a context manager: on an exception the write is aborted (local file removed, multipart
    upload aborted) instead of committed; :meth:`close` returns the size and checksums. A writer
    that is neither closed nor aborted never commits anything either: on S3 its upload stays open
    until aborted here or by ``shardckpt clean``. ``open_sink`` opens where the bytes go (the
    backend's sink), once the arguments are checked. ``digest``: also the per-chunk digest of that
    algorithm (:mod:`shardckpt.storage.digest`), on the thread that computes the CRC32C;
    :attr:`digest` holds the file's digest once closed.
    """

    def __init__(self, open_sink: Callable[[], Sink], url: str, chunk_size: int,
                 digest: str | None = None) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size {chunk_size}: must be >= 1")
        self.url, self.chunk_size = url, chunk_size
        self.size = 0
        self.chunks: list[int] = []
        self._chunk_crc = 0
        self._chunk_fill = 0
        self._closed = False
        self._hasher = ChunkHasher(chunk_size, digest) if digest else None
        self.digest: str | None = None
        self._sink = open_sink()

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        if not n:
            return
        if self._closed:
            raise StorageError(f"{self.url}: write after close or abort")
        if n >= _PARALLEL_CRC_BYTES:  # checksum on another thread while the sink copies the bytes
            pending = _crc_pool().submit(self._checksum, view)
            try:
                self._sink.write(view)
            finally:
                pending.result()
        else:
            self._checksum(view)
            self._sink.write(view)
        self.size += n

    def _checksum(self, view: memoryview) -> None:
        n, pos = len(view), 0
        while pos < n:
            take = min(n - pos, self.chunk_size - self._chunk_fill)
            self._chunk_crc = crc32c(view[pos:pos + take], self._chunk_crc)
            if self._hasher is not None:  # the same piece, while it is in the cache
                self._hasher.update(view[pos:pos + take])
            self._chunk_fill += take
            pos += take
            if self._chunk_fill == self.chunk_size:
                self.chunks.append(self._chunk_crc)
                self._chunk_crc, self._chunk_fill = 0, 0

    @property
    def crc(self) -> int:
        """CRC32C of everything written so far, derived from the per-chunk CRCs (one pass a byte)."""
        chunks = self.chunks + [self._chunk_crc] if self._chunk_fill else self.chunks
        return crc32c_of_chunks(chunks, self.chunk_size, self.size)

    def close(self) -> tuple[int, int, tuple[int, ...]]:
        """Flush, make durable (fsync locally; complete the upload remotely); return checksums."""
        if self._chunk_fill:
            self.chunks.append(self._chunk_crc)
            self._chunk_crc, self._chunk_fill = 0, 0
        try:
            self._sink.close(self.size)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        if self._hasher is not None:
            self.digest = self._hasher.hexdigest()
        return self.size, self.crc, tuple(self.chunks)

    def abort(self) -> None:
        """Throw the partial write away; never commits a partial object."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sink.abort()
        except Exception as e:  # noqa: BLE001 - cleanup is best effort; the original error propagates
            log.warning("could not clean up partial %s (%s); `shardckpt clean` on its prefix removes it",
                        self.url, describe_error(e))

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
WRITEBACK_BYTES = 8 << 20


def start_writeback(fd: int, start: int, n: int) -> None:
    """Start writeback of bytes ``[start, start + n)`` of ``fd`` without waiting for it
    (``sync_file_range``, Linux; advisory: elsewhere nothing, and only fsync makes durable)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, start, n, _SYNC_FILE_RANGE_WRITE)


class LocalSink:
    """A local file, made durable by ``fsync`` on close.

    Every :data:`WRITEBACK_BYTES` written, writeback of what was written so far is started
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait for it), so the disk works
    while the next bytes are produced instead of all at once in the final ``fsync``; the
    ``fsync`` on close is what makes the file durable either way.
    """

    def __init__(self, backend: Any, path: str, url: str) -> None:
        self.path, self.url = path, url
        self._written = 0
        self._kicked = 0

        def open_local() -> Any:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            return open(self.path, "wb")  # noqa: SIM115
        self.f = backend.call("open", url, open_local)

    def write(self, view: memoryview) -> None:
        with mapped_errors("write", self.url):
            self.f.write(view)
            self._written += len(view)
            if _SYNC_FILE_RANGE is not None and self._written - self._kicked >= WRITEBACK_BYTES:
                # advisory: an error here (a filesystem without it) changes nothing; fsync decides
                self.f.flush()
                _SYNC_FILE_RANGE(self.f.fileno(), self._kicked, self._written - self._kicked,
                                 _SYNC_FILE_RANGE_WRITE)
                self._kicked = self._written

    def close(self, size: int) -> None:
        with mapped_errors("close", self.url):
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


class FsspecSink:
    """Any other fsspec filesystem (``memory://``, ...) through ``fs.open("wb")``.

    fsspec files commit on ``close()`` and on ``__del__``; abort discards, then marks the file
    closed *before* anything else can fail, so neither path can commit a partial object.
    """

    def __init__(self, backend: Any, path: str, url: str) -> None:
        self.backend, self.path, self.url = backend, path, url
        self.f = backend.call("open", url, lambda: backend.fs.open(path, "wb"))

    def write(self, view: memoryview) -> None:
        try:
            self.f.write(view)
        except Exception as e:  # noqa: BLE001
            raise map_error(e, "write", self.url) from e

    def close(self, size: int) -> None:
        try:
            self.f.close()
        except Exception as e:  # noqa: BLE001
            raise map_error(e, "close", self.url) from e

    def abort(self) -> None:
        f = self.f
        try:
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()
        finally:
            try:
                f.closed = True  # keeps AbstractBufferedFile.__del__ from committing
            except AttributeError:
                pass  # io.BytesIO (memory://): read-only, and nothing to complete
        if discard is None:  # a plain file object: nothing to discard, remove what landed
            f.close()
        self.backend.rm(self.path, self.url)
