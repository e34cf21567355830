"""The :class:`Storage` handle: paths, retried calls, whole/ranged/checked reads, atomic writes."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from shardckpt.errors import CommitConflictError, IntegrityError, StorageError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import places
from shardckpt.storage.options import split_options
from shardckpt.storage.retry import (
    NotFoundError, RetryPolicy, _describe, _is_retryable, _map_error, mapped_errors, retry_call,
)
from shardckpt.storage.writer import StreamWriter, crc32c

log = logging.getLogger(__name__)
T = TypeVar("T")


class Storage:
    """A root URL plus an fsspec filesystem. Methods take paths relative to the root."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 retry: RetryPolicy | None = None) -> None:
        import fsspec  # lazy: fsspec pulls in little, but keep `--help` fast

        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        fs_options, policy, self.tuning, s3fs_retries = split_options(url, storage_options)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **fs_options)
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"{url}: cannot open this location: {e}", url) from e
        except OSError as e:  # filesystems that connect or open an archive when created (ftp, zip)
            raise StorageError(f"{url}: cannot open this location: {_describe(e)}", url) from e
        if s3fs_retries is not None:
            self.fs.retries = s3fs_retries
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.retry = retry or policy
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.is_local = protocol in ("file", "local")
        self.is_s3 = protocol in ("s3", "s3a")
        #: :meth:`map_chunks` works here: a local file system on a POSIX system.
        self.can_map = self.is_local and os.name == "posix"

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # ---------------------------------------------------------------------------- helpers

    def full(self, rel: str) -> str:
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root not in ("", "/") else f"{self.root}{rel}"

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> "Storage":
        """A Storage rooted at ``rel`` below this one (same filesystem and options)."""
        s = object.__new__(Storage)
        s.__dict__.update(self.__dict__)
        s.url, s.root = self.url_of(rel), self.full(rel)
        return s

    def bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.full(rel))
        return bucket, key

    def call(self, what: str, rel: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        """Run ``fn`` with retries on transient errors until the deadline; map errors.

        ``deadline`` (``time.monotonic()`` seconds) lets several calls share one; by default it
        is the policy's ``deadline_s`` from now. Backoff is capped, exponential and jittered.
        """
        return retry_call(self.retry, what, self.url_of(rel), fn, deadline)

    # ------------------------------------------------------------------------------ reads

    def exists(self, rel: str) -> bool:
        return self.call("exists", rel, lambda: self.fs.exists(self.full(rel)))

    def isdir(self, rel: str = "") -> bool:
        return self.call("isdir", rel, lambda: self.fs.isdir(self.full(rel)))

    def size(self, rel: str) -> int:
        info = self.call("stat", rel, lambda: self.fs.info(self.full(rel)))
        if info.get("type") == "directory":
            raise StorageError(f"{self.url_of(rel)}: is a directory, expected a file", self.url_of(rel))
        if self.is_local and info.get("type") != "file":  # a FIFO or device: reads could block
            raise _not_regular(self.url_of(rel), info.get("mode"))
        return int(info["size"])

    def ls(self, rel: str = "") -> list[str]:
        """Names (not paths) directly below ``rel``; empty if it does not exist."""
        try:
            entries = self.call("list", rel, lambda: self.fs.ls(self.full(rel), detail=False))
        except NotFoundError:
            return []
        base = self.full(rel).rstrip("/")
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base})

    def read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """Raw bytes ``[start, end)`` of ``rel`` (no checksum; see :meth:`read_checked`).

        On an async object store a range larger than ``tuning.range_piece`` is fetched as
        concurrent ranged GETs; a failed piece is retried alone, all under one deadline.
        """
        path = self.full(rel)
        if self.is_local:
            def local() -> bytes:
                with open_regular(path, self.url_of(rel)) as f:
                    if start:
                        f.seek(start)
                    return f.read(-1 if end is None else end - (start or 0))
            return self.call("read", rel, local)
        piece = self.tuning.range_piece
        if (start is None or end is None or end - start <= piece
                or not getattr(self.fs, "async_impl", False)):
            return self.call("read", rel, lambda: self.fs.cat_file(path, start=start, end=end))
        return self._read_pieces(rel, path, start, end, piece)

    def _read_pieces(self, rel: str, path: str, start: int, end: int, piece: int) -> bytes:
        deadline = time.monotonic() + self.retry.deadline_s
        bounds = [(a, min(end, a + piece)) for a in range(start, end, piece)]
        out: list[Any] = [None] * len(bounds)
        step = max(1, self.tuning.concurrency)
        for i in range(0, len(bounds), step):  # at most `concurrency` GETs in flight
            group = bounds[i:i + step]
            try:
                got = self.fs.cat_ranges([path] * len(group), [a for a, _ in group],
                                         [b for _, b in group], on_error="return")
            except Exception as e:  # noqa: BLE001 - a failure of the whole batch: retry piecewise
                got = [e] * len(group)
            out[i:i + step] = got
        for i, ((a, b), data) in enumerate(zip(bounds, out)):
            if isinstance(data, BaseException):
                if not _is_retryable(data):
                    raise _map_error(data, "read", self.url_of(rel)) from data
                log.info("read of %s [%d, %d) failed (%s); retrying", self.url_of(rel), a, b,
                         _describe(data))
                out[i] = self.call("read", rel, lambda a=a, b=b: self.fs.cat_file(path, start=a, end=b),
                                   deadline=deadline)
        return b"".join(out)

    def read_prefix(self, rel: str, n: int) -> bytes:
        """At most the first ``n`` bytes of ``rel``: one bounded read under one retry deadline,
        whatever the file claims its size is (a local file must be a regular file)."""
        path = self.full(rel)
        if self.is_local:
            def local() -> bytes:
                with open_regular(path, self.url_of(rel)) as f:
                    return _read_upto(f, n)
            return self.call("read", rel, local)
        return self.call("read", rel, lambda: self.fs.cat_file(path, start=0, end=n))

    def read_limited(self, rel: str, limit: int) -> bytes:
        """The whole of a small file, refusing one larger than ``limit`` (reads at most
        ``limit + 1`` bytes, in one operation)."""
        data = self.read_prefix(rel, limit + 1)
        if len(data) > limit:
            raise StorageError(f"{self.url_of(rel)}: at least {len(data)} bytes, more than the "
                               f"{limit} allowed", self.url_of(rel))
        return data

    def read_chunks(self, entry: FileEntry, chunk_size: int, c0: int, c1: int, prefix: str = "") -> memoryview:
        """Whole chunks ``[c0, c1)`` of ``entry``, each checked against its recorded CRC32C.

        From the first chunk that fails, the range is read once more (a transfer can be bad where
        the object is not) before an :class:`IntegrityError` names the object and the bytes.
        """
        rel = prefix + entry.path
        a, b = c0 * chunk_size, min(entry.size, c1 * chunk_size)
        view = memoryview(self._read_exact(rel, entry, a, b))
        bad = _first_bad_chunk(view, entry, chunk_size, c0, c1)
        if bad is None:
            return view
        i = bad[0]
        log.info("%s: bytes [%d, %d) failed their CRC32C check; reading them again",
                 self.url_of(rel), i * chunk_size, min(entry.size, (i + 1) * chunk_size))
        tail = memoryview(self._read_exact(rel, entry, i * chunk_size, b))
        again = _first_bad_chunk(tail, entry, chunk_size, i, c1)
        if again is not None:
            j, got = again
            raise IntegrityError(
                f"{self.url_of(rel)}: bytes [{j * chunk_size}, {min(entry.size, (j + 1) * chunk_size)}) "
                f"fail their CRC32C check (recorded {entry.chunk_crc32c[j]:08x}, read {got:08x}, "
                "read twice); the file is corrupted")
        joined = bytearray(view[:i * chunk_size - a])
        joined += tail
        return memoryview(joined)

    def map_chunks(self, entry: FileEntry, chunk_size: int, c0: int, c1: int, prefix: str = "",
                   checked: bytearray | None = None,
                   ranges: Sequence[tuple[int, int]] | None = None) -> tuple[memoryview, int]:
        """Local files only: chunks ``[c0, c1)`` of ``entry`` mapped read-only (no copy into user
        space), as one view of bytes ``[c0 · chunk_size, min(size, c1 · chunk_size))``, and the
        number of bytes checked by this call.

        The chunks under ``ranges`` (absolute byte ranges inside the span; all of it by default)
        are checked against their CRC32C, except those ``checked`` (a bitmap, one bit per chunk
        of the file) marks as checked already; newly checked ones are marked. Pages are only
        touched where they are read, so memory follows the ranges, not the span. The file's size
        is checked first, so a truncated file is an :class:`IntegrityError`, not a fault on
        access. The mapping lives as long as the returned view (or a slice of it). A chunk that
        fails is read again through :meth:`read_chunks`, whose error names the object and bytes.
        """
        import mmap

        rel = prefix + entry.path
        a, b = c0 * chunk_size, min(entry.size, c1 * chunk_size)
        if a >= b:
            return memoryview(b""), 0
        path = self.full(rel)

        def open_map() -> "tuple[mmap.mmap, int]":
            fd = _open_regular_fd(path, self.url_of(rel))
            try:
                size = os.fstat(fd).st_size
                if size != entry.size:
                    raise IntegrityError(f"{self.url_of(rel)}: {size} bytes, the manifest records "
                                         f"{entry.size}; the file is truncated or replaced")
                off = a - a % mmap.ALLOCATIONGRANULARITY
                return mmap.mmap(fd, b - off, prot=mmap.PROT_READ, offset=off), off
            finally:
                os.close(fd)
        mapped, off = self.call("read", rel, open_map)
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
                    self.read_chunks(entry, chunk_size, i, i + 1, prefix)  # raises, naming the bytes
                    raise IntegrityError(f"{self.url_of(rel)}: bytes [{i * chunk_size}, "
                                         f"{min(entry.size, (i + 1) * chunk_size)}) changed while "
                                         "being read")
                fresh += min(entry.size, (i + 1) * chunk_size) - i * chunk_size
                if checked is not None:
                    checked[i >> 3] |= 1 << (i & 7)
        return view, fresh

    def _read_exact(self, rel: str, entry: FileEntry, a: int, b: int) -> bytes:
        data = self.read(rel, a, b)
        if len(data) != b - a:
            raise IntegrityError(f"{self.url_of(rel)}: truncated: bytes [{a}, {b}) returned "
                                 f"{len(data)} bytes (the manifest records {entry.size})")
        return data

    def read_checked(self, entry: FileEntry, chunk_size: int, start: int, end: int,
                     prefix: str = "") -> memoryview:
        """Bytes ``[start, end)`` of ``entry``, reading whole chunks and checking each CRC32C."""
        rel = prefix + entry.path
        if not 0 <= start <= end <= entry.size:
            raise IntegrityError(f"{self.url_of(rel)}: range [{start}, {end}) is outside its "
                                 f"{entry.size} bytes")
        if start == end:
            return memoryview(b"")
        c0, c1 = start // chunk_size, -(-end // chunk_size)
        view = self.read_chunks(entry, chunk_size, c0, c1, prefix)
        a = c0 * chunk_size
        return view[start - a:end - a]

    def read_checked_many(self, requests: Sequence[tuple[FileEntry, int, int]], chunk_size: int,
                          prefix: str = "", workers: int = 8) -> list[memoryview]:
        """:meth:`read_checked` for many ranges, coalesced per file and read concurrently."""
        by_file: dict[str, list[int]] = {}
        for i, (e, _, _) in enumerate(requests):
            by_file.setdefault(e.path, []).append(i)
        spans: list[tuple[FileEntry, int, int, list[int]]] = []
        for idx in by_file.values():
            idx.sort(key=lambda i: requests[i][1])
            cur: list[int] = []
            lo = hi = 0
            for i in idx:
                e, a, b = requests[i]
                ca, cb = a // chunk_size * chunk_size, -(-b // chunk_size) * chunk_size
                if cur and ca <= hi:
                    hi = max(hi, cb)
                    cur.append(i)
                else:
                    if cur:
                        spans.append((requests[cur[0]][0], lo, min(hi, requests[cur[0]][0].size), cur))
                    cur, lo, hi = [i], ca, cb
            if cur:
                spans.append((requests[cur[0]][0], lo, min(hi, requests[cur[0]][0].size), cur))
        out: list[memoryview | None] = [None] * len(requests)

        def fetch(span: tuple[FileEntry, int, int, list[int]]) -> None:
            e, lo, hi, members = span
            view = self.read_checked(e, chunk_size, lo, hi, prefix)
            for i in members:
                _, a, b = requests[i]
                out[i] = view[a - lo:b - lo]

        if len(spans) <= 1 or workers <= 1:
            for sp in spans:
                fetch(sp)
        else:
            with ThreadPoolExecutor(min(workers, len(spans))) as pool:
                list(pool.map(fetch, spans))
        return out  # type: ignore[return-value]

    # ----------------------------------------------------------------------------- writes

    def writer(self, rel: str, chunk_size: int) -> StreamWriter:
        return StreamWriter(self, rel, chunk_size)

    def create_only(self, rel: str, data: bytes) -> None:
        """Write ``data`` at ``rel`` only if nothing is there: the commit point of a checkpoint.

        Local: write a temporary file, fsync, then ``link`` it into place (fails if the target
        exists), so the target is never seen half-written. S3: one PUT with ``If-None-Match: *``.
        Raises :class:`CommitConflictError` if the object exists.
        """
        url = self.url_of(rel)
        path = self.full(rel)
        conflict = CommitConflictError(f"{url} already exists: another save committed here first; "
                                       "nothing was overwritten", url)
        if self.is_local:
            def link(tmp: str, target: str) -> None:
                try:
                    os.link(tmp, target)
                except FileExistsError as e:
                    raise conflict from e
                except OSError as e:
                    raise _map_error(e, "commit", url) from e
            with mapped_errors("commit", url):
                _write_local(path, data, link)
            return
        if self.is_s3:
            from shardckpt.storage.s3 import put_if_absent

            put_if_absent(self, rel, data, conflict)
            return
        # other filesystems: best effort (check, then write)
        if self.exists(rel):
            raise conflict
        self.call("write", rel, lambda: self.fs.pipe_file(path, data))

    def put(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically where the filesystem allows (local: rename)."""
        path = self.full(rel)
        if self.is_local:
            with mapped_errors("write", self.url_of(rel)):
                _write_local(path, data, os.replace)
            return
        if self.is_s3:
            bucket, key = self.bucket_key(rel)
            self.call("write", rel, lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data))
            return
        self.call("write", rel, lambda: self.fs.pipe_file(path, data))

    def rm(self, rel: str, recursive: bool = False) -> None:
        try:
            self.call("remove", rel, lambda: self.fs.rm(self.full(rel), recursive=recursive))
        except NotFoundError:
            pass

    def fsync_dir(self, rel: str = "") -> None:
        """Local: make the entries of directory ``rel`` durable (a file created in it survives a
        power loss only once its directory is synced). Object stores have no directories: no-op."""
        if self.is_local:
            _fsync_dir(self.full(rel))

    def list_sizes(self, rel: str = "") -> dict[str, int]:
        """Name -> size of the files directly below ``rel``, fresh from one listing (on S3 one
        LIST of the prefix, not a HEAD per object); empty if ``rel`` does not exist."""
        path = self.full(rel)

        def listing() -> list[Any]:
            self.fs.invalidate_cache(path)
            return self.fs.ls(path, detail=True)
        try:
            entries = self.call("list", rel, listing)
        except NotFoundError:
            return {}
        base = path.rstrip("/")
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries
                if e.get("type") != "directory" and e["name"].rstrip("/") != base}

    def location(self, rel: str = "") -> tuple[str, str]:
        """A key equal for two handles on the same place: see :func:`.places.location`."""
        return places.location(self, rel)

    def ensure_free_space(self, rel: str, nbytes: int, what: str) -> None:
        """Local: refuse, before anything is written, a write of ``nbytes`` below ``rel`` that its
        file system has no room for (:class:`InsufficientSpaceError`, naming both figures and the
        path). Object stores: no-op. See :func:`.places.ensure_free_space`."""
        places.ensure_free_space(self, rel, nbytes, what)


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    return Storage(url, storage_options)


def iter_file_chunks(storage: Storage, rel: str, chunk_size: int, limit: int | None = None) -> Iterator[bytes]:
    """Sequential reads of ``rel`` in ``chunk_size`` pieces (bounded memory), up to ``limit`` bytes.

    Remote: ranged reads of several chunks at a time (retried), the next read ahead while the
    caller checks the current one; memory is about two such reads.
    """
    path = storage.full(rel)
    url = storage.url_of(rel)
    if storage.is_local:
        try:
            f = open_regular(path, url)
        except OSError as e:
            raise _map_error(e, "open", url) from e
        with f:
            remaining = limit
            while remaining is None or remaining > 0:
                n = chunk_size if remaining is None else min(chunk_size, remaining)
                with mapped_errors("read", url):
                    data = f.read(n)
                if not data:
                    return
                if remaining is not None:
                    remaining -= len(data)
                yield data
        return
    total = storage.size(rel)
    if limit is not None:
        total = min(total, limit)
    step = max(chunk_size, storage.tuning.range_piece // chunk_size * chunk_size)
    starts = list(range(0, total, step))
    if not starts:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="shardckpt-readahead") as pool:
        ahead = pool.submit(storage.read, rel, 0, min(total, step))
        for k, a in enumerate(starts):
            data = ahead.result()
            if k + 1 < len(starts):
                nxt = starts[k + 1]
                ahead = pool.submit(storage.read, rel, nxt, min(total, nxt + step))
            if len(data) != min(total, a + step) - a:
                raise StorageError(f"{url}: bytes [{a}, {min(total, a + step)}) returned {len(data)} bytes")
            view = memoryview(data)
            for lo in range(0, len(view), chunk_size):
                yield bytes(view[lo:lo + chunk_size])


def _not_regular(url: str, mode: int | None = None) -> StorageError:
    kind = ("a named pipe (FIFO)" if mode is not None and stat.S_ISFIFO(mode) else
            "a device" if mode is not None and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) else
            "a socket" if mode is not None and stat.S_ISSOCK(mode) else "a pipe, device or socket")
    return StorageError(f"{url}: not a regular file but {kind}; shardckpt reads only regular "
                        "files", url)


def _open_regular_fd(path: str, url: str) -> int:
    """Open ``path`` read-only without blocking (a FIFO would block ``open`` until a writer came),
    and refuse it unless it is a regular file once symlinks are followed."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise _not_regular(url, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_upto(f: Any, n: int) -> bytes:
    """At most ``n`` bytes of ``f``, allocating for what the file holds rather than for ``n``."""
    first = min(n, os.fstat(f.fileno()).st_size + 1)
    data = f.read(first)
    if len(data) < first or len(data) >= n:
        return data
    parts = [data]  # the file grew since fstat: read on in bounded pieces
    while (left := n - sum(map(len, parts))) > 0:
        more = f.read(min(left, 1 << 20))
        if not more:
            break
        parts.append(more)
    return b"".join(parts)


def open_regular(path: str, url: str) -> Any:
    """A binary file object for a local regular file (see :func:`_open_regular_fd`)."""
    return os.fdopen(_open_regular_fd(path, url), "rb")


def _first_bad_chunk(view: memoryview, entry: FileEntry, chunk_size: int, c0: int,
                     c1: int) -> tuple[int, int] | None:
    """(index, CRC read) of the first chunk in ``view`` (chunks ``[c0, c1)``) that fails."""
    for i in range(c0, c1):
        lo = (i - c0) * chunk_size
        got = crc32c(view[lo:lo + chunk_size])
        if got != entry.chunk_crc32c[i]:
            return i, got
    return None


def _write_local(path: str, data: bytes, install: Callable[[str, str], None]) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, ``install(tmp, path)`` (link
    or rename), fsync the directory; the temporary file never outlives the call."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        install(tmp, path)
        _fsync_dir(os.path.dirname(path))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
