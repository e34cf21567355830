"""The local disk: regular files only, atomic installs (write, fsync, link or rename), durable
directories, memory-mapped reads on POSIX, free space checked before a large write."""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import stat
import uuid
from typing import Any, ClassVar
from collections.abc import Callable, Collection, Iterator, Sequence

from shardckpt.errors import IntegrityError, StorageError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import confined, places
from shardckpt.storage.backends import Backend, conflict_error
from shardckpt.storage.checked import ChunkCheck, spans
from shardckpt.storage.options import BackendOptions, Tuning, fsspec_option_names
from shardckpt.storage.retry import NotFoundError, RetryPolicy, map_error, mapped_errors
from shardckpt.storage.writer import LocalSink, Sink


#: URL prefixes of the local file system.
LOCAL_PREFIXES = ("file://", "local://")


def local_path(url: str) -> str | None:
    """The absolute path ``url`` names when it is a plain path or a ``file://`` URL (``~``
    expanded), else None: other protocols and chained URLs (``a::b``) are fsspec's."""
    if "::" in url:
        return None
    for prefix in LOCAL_PREFIXES:
        if url.startswith(prefix):
            url = url[len(prefix):]
            break
    else:
        if "://" in url:
            return None
    path = os.path.expanduser(url) if url.startswith("~") else url
    return path if path.startswith("/") else os.path.join(os.getcwd(), path)


class LocalBackend(Backend):
    """A local file system (``file://`` or a plain path), through ``os`` calls: fsspec's
    ``LocalFileSystem`` is created only if something asks for :attr:`fs` or options are given
    (they are its options: ``auto_mkdir`` and the like). ``create_only`` links a complete
    temporary file into place; ``replace_if`` checks, then renames one, under the writer's
    lease."""

    schemes: ClassVar[tuple[str, ...]] = ("file", "local")
    can_map: ClassVar[bool] = os.name == "posix"

    def __init__(self, fs: Any, retry: RetryPolicy, tuning: Tuning) -> None:
        self._fs, self.retry, self.tuning = fs, retry, tuning
        self.protocol = "file"

    @classmethod
    def known_options(cls) -> Collection[str]:
        from fsspec.implementations.local import LocalFileSystem

        return fsspec_option_names(LocalFileSystem)

    @classmethod
    def open(cls, url: str, options: BackendOptions) -> tuple[Backend, str]:
        """Without options, ``os`` serves the path and fsspec is not imported."""
        path = None if options.fs else local_path(url)
        if path is None:
            return super().open(url, options)
        return cls(None, options.retry, options.tuning), path.rstrip("/") or "/"

    @property
    def fs(self) -> Any:
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem("file")
        return self._fs

    def exists(self, path: str, url: str) -> bool:
        return self.call("exists", url, lambda: os.path.exists(path))

    def isdir(self, path: str, url: str) -> bool:
        return self.call("isdir", url, lambda: os.path.isdir(path))

    def size(self, path: str, url: str) -> int:
        st = self.call("stat", url, lambda: os.stat(path))
        if stat.S_ISDIR(st.st_mode):
            raise StorageError(f"{url}: is a directory, expected a file", url)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device: reads could block
            raise _not_regular(url, st.st_mode)
        return st.st_size

    def ls(self, path: str, url: str) -> list[str]:
        def listing() -> list[str]:
            try:
                return sorted(os.listdir(path))
            except NotADirectoryError:
                return []
        try:
            return self.call("list", url, listing)
        except NotFoundError:
            return []

    def list_sizes(self, path: str, url: str) -> dict[str, int]:
        def listing() -> dict[str, int]:
            out: dict[str, int] = {}
            if not os.path.isdir(path):
                return out
            with os.scandir(path) as entries:
                for e in entries:
                    try:
                        if not e.is_dir():
                            out[e.name] = e.stat().st_size
                    except FileNotFoundError:  # removed, or a dangling link
                        continue
            return out
        try:
            return self.call("list", url, listing)
        except NotFoundError:
            return {}

    def rm(self, path: str, url: str, recursive: bool = False) -> None:
        def remove() -> None:
            if os.path.isdir(path) and not os.path.islink(path):
                if recursive:
                    shutil.rmtree(path)
                else:
                    os.rmdir(path)
            else:
                os.remove(path)
        try:
            self.call("remove", url, remove)
        except NotFoundError:
            pass

    def remove_inside(self, root: str, rel: str, root_url: str, recursive: bool) -> bool:
        """Remove ``rel`` below ``root`` without following or removing any symbolic link
        (:func:`.confined.remove_inside`)."""
        url = f"{root_url}/{rel}"
        try:
            return self.call("remove", url, lambda: confined.remove_inside(root, rel, root_url, recursive))
        except NotFoundError:
            return False

    def first_link(self, root: str, rel: str, root_url: str) -> tuple[str, str] | None:
        return self.call("stat", f"{root_url}/{rel}", lambda: confined.first_link(root, rel, root_url))

    def read(self, path: str, url: str, start: int | None = None, end: int | None = None) -> bytes:
        def local() -> bytes:
            with open_regular(path, url) as f:
                if start:
                    f.seek(start)
                return f.read(-1 if end is None else end - (start or 0))
        return self.call("read", url, local)

    def read_prefix(self, path: str, url: str, n: int) -> bytes:
        def local() -> bytes:
            with open_regular(path, url) as f:
                return _read_upto(f, n)
        return self.call("read", url, local)

    def iter_chunks(self, path: str, url: str, chunk_size: int, limit: int | None) -> Iterator[bytes]:
        try:
            f = open_regular(path, url)
        except OSError as e:
            raise map_error(e, "open", url) from e
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

    def map_range(self, path: str, url: str, a: int, b: int, size: int) -> tuple[Any, int]:
        """Bytes ``[a, b)`` mapped read-only: (the mapping, its offset in the file). The file must
        be ``size`` bytes (else :class:`IntegrityError`: truncated or replaced), so that no access
        faults past its end."""
        import mmap

        def open_map() -> tuple[mmap.mmap, int]:
            fd = _open_regular_fd(path, url)
            try:
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise IntegrityError(f"{url}: {actual} bytes, the manifest records {size}; the "
                                         "file is truncated or replaced")
                off = a - a % mmap.ALLOCATIONGRANULARITY
                return mmap.mmap(fd, b - off, prot=mmap.PROT_READ, offset=off), off
            finally:
                os.close(fd)
        return self.call("read", url, open_map)

    def sink(self, path: str, url: str) -> Sink:
        return LocalSink(self, path, url)

    def open_for_write(self, path: str, url: str, spare: str | None = None) -> int:
        """``path`` opened for writing, created or truncated (``0644`` less the umask), with its
        missing directories: what :class:`LocalSink` opens, as a descriptor. ``spare``: a file
        renamed to ``path`` first and opened as it is (a new file where it is gone)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if spare is not None:
            try:
                os.rename(spare, path)
            except FileNotFoundError:
                pass
            else:
                return os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def create_only(self, path: str, url: str, data: bytes) -> None:
        """Write a temporary file, fsync, then ``link`` it into place (fails if the target
        exists), so the target is never seen half-written."""
        conflict = conflict_error(url)

        def link(tmp: str, target: str) -> None:
            try:
                os.link(tmp, target)
            except FileExistsError as e:
                raise conflict from e
            except OSError as e:
                raise map_error(e, "commit", url) from e
        with mapped_errors("commit", url):
            _write_local(path, data, link)

    def put(self, path: str, url: str, data: bytes) -> None:
        with mapped_errors("write", url):
            _write_local(path, data, os.replace)

    def rename(self, path: str, to: str, url: str) -> bool:
        """One ``rename(2)``; ``to`` must not exist (a directory there, even empty, is refused)."""
        def move() -> None:
            parent = os.path.dirname(to)
            os.makedirs(parent, exist_ok=True)
            if os.path.lexists(to):
                raise FileExistsError(errno.EEXIST, "already exists", to)
            os.rename(path, to)
            _fsync_dir(parent)
            _fsync_dir(os.path.dirname(path))
        self.call("rename", url, move)
        return True

    def staging_name(self, rel: str, token: str) -> str:
        return f"{rel}.partial-{token}"

    def install(self, staged: str, path: str, url: str) -> None:
        self.call("rename", url, lambda: os.replace(staged, path))

    def fsync_dir(self, path: str) -> None:
        _fsync_dir(path)

    def location(self, path: str) -> tuple[str, str]:
        return "file", os.path.realpath(path or "/")

    def ensure_free_space(self, path: str, url: str, nbytes: int, what: str) -> None:
        places.ensure_free_space(path, url, nbytes, what)


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


# ------------------------------------------- straight into the caller's memory (local files)


def pread_full(f: Any, view: memoryview, pos: int, url: str) -> None:
    """Fill ``view`` from descriptor ``f`` at ``pos``; a file that ends first is an IntegrityError."""
    done = 0
    while done < len(view):
        n = os.preadv(f, [view[done:]], pos + done)
        if n <= 0:
            raise IntegrityError(f"{url}: ends at byte {pos + done}, short of its recorded size")
        done += n


def read_local_into(path: str, url: str, entry: FileEntry, chunk_size: int,
                    pieces: Sequence[tuple[int, int, memoryview]]) -> None:
    """Fill each target of ``pieces`` ((start, end, target), non-overlapping byte ranges of
    ``entry``) from the local file ``path``, checking the CRC32C of every chunk touched."""
    if os.path.getsize(path) != entry.size:
        raise IntegrityError(f"{url}: {os.path.getsize(path)} bytes, the manifest records {entry.size}")
    ordered = sorted(pieces, key=lambda p: p[0])
    if any(p[1] > q[0] for p, q in itertools.pairwise(ordered)):  # bytes wanted twice: one at a time
        for piece in ordered:
            read_local_into(path, url, entry, chunk_size, [piece])
        return
    scratch = bytearray(chunk_size)
    f = open_regular(path, url)  # a regular file, opened without blocking on a FIFO
    fd = f.fileno()
    try:
        i, n = 0, len(ordered)
        while i < n:
            # one run of touched chunks: pieces whose chunks overlap or touch
            c0 = ordered[i][0] // chunk_size
            c1 = -(-ordered[i][1] // chunk_size)
            j = i + 1
            while j < n and ordered[j][0] // chunk_size <= c1:
                c1 = max(c1, -(-ordered[j][1] // chunk_size))
                j += 1
            _read_run(fd, url, entry, chunk_size, c0, c1, ordered[i:j], scratch)
            i = j
    finally:
        f.close()


def _read_run(fd: int, url: str, entry: FileEntry, cs: int, c0: int, c1: int,
              pieces: Sequence[tuple[int, int, memoryview]], scratch: bytearray) -> None:
    check = ChunkCheck(entry, cs, url, c0)
    for off, view in spans(entry.size, cs, c0, c1, pieces, memoryview(scratch)):
        pread_full(fd, view, off, url)
        check.feed(off, view)
