"""Storage over fsspec: the only module that touches files or object stores.

Paths above this layer are strings relative to a checkpoint's root URL (``str``, never ``Path``:
``Path`` mangles ``s3://``). Every failure becomes a :class:`~shardckpt.errors.StorageError`
(original exception as ``__cause__``) that names the object; every checked read verifies CRC32C
per chunk, ranged reads included.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import crc32c as _crc32c

from shardckpt.errors import (
    CommitConflictError, IntegrityError, ShardckptError, StorageError,
)
from shardckpt.manifest import FileEntry

log = logging.getLogger(__name__)
T = TypeVar("T")


def crc32c(data: Any, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


class NotFoundError(StorageError):
    """The object does not exist."""


# --------------------------------------------------------------------------------- retries


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """One overall deadline per operation, capped exponential backoff, an explicit retryable list."""

    deadline_s: float = 120.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0


_RETRYABLE_ERRNO = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.EREMOTEIO,
                    errno.ECONNREFUSED, errno.EPIPE, errno.ECONNABORTED}
_RETRYABLE_NAMES = {
    # botocore / aiohttp / asyncio transport errors, matched by name so neither is imported here
    "ConnectionClosedError", "EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError",
    "ResponseStreamingError", "IncompleteReadError", "ClientPayloadError", "ServerDisconnectedError",
    "ClientConnectorError", "ClientOSError", "ServerTimeoutError", "TimeoutError",
    "ProtocolError", "ContentLengthError",
}


def _is_retryable(e: BaseException) -> bool:
    for cls in type(e).__mro__:
        if cls.__name__ in _RETRYABLE_NAMES:
            return True
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PermissionError,
                                                      FileExistsError, IsADirectoryError)):
        return e.errno in _RETRYABLE_ERRNO
    return False


def _map_error(e: BaseException, what: str, url: str) -> StorageError:
    if isinstance(e, FileNotFoundError):
        return NotFoundError(f"{url}: not found ({what})", url)
    if isinstance(e, PermissionError):
        return StorageError(f"{url}: permission denied ({what}): {e}", url)
    return StorageError(f"{url}: {what} failed: {type(e).__name__}: {e}", url)


# --------------------------------------------------------------------------------- storage


def storage_options_from_env(url: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """fsspec options for ``url``: the user's, plus an S3 endpoint from ``AWS_ENDPOINT_URL(_S3)``."""
    opts = dict(options or {})
    if url.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        ck = dict(opts.get("client_kwargs") or {})
        if endpoint and "endpoint_url" not in ck and "endpoint_url" not in opts:
            ck["endpoint_url"] = endpoint
        if ck:
            opts["client_kwargs"] = ck
    return opts


class Storage:
    """A root URL plus an fsspec filesystem. Methods take paths relative to the root."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 retry: RetryPolicy | None = None) -> None:
        import fsspec  # lazy: fsspec pulls in little, but keep `--help` fast

        self.url = url.rstrip("/") or url
        self.storage_options = storage_options_from_env(url, storage_options)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"{url}: cannot open this location: {e}", url) from e
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.retry = retry or RetryPolicy()
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.is_local = protocol in ("file", "local")

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
        s.url, s.storage_options, s.fs = self.url_of(rel), self.storage_options, self.fs
        s.root, s.retry, s.is_local = self.full(rel), self.retry, self.is_local
        return s

    def call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries on transient errors until the policy's deadline; map errors."""
        deadline = time.monotonic() + self.retry.deadline_s
        backoff = self.retry.initial_backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except ShardckptError:
                raise
            except Exception as e:  # noqa: BLE001 - mapped below, never swallowed
                if _is_retryable(e) and time.monotonic() + backoff < deadline:
                    log.warning("%s of %s failed (%s: %s); retry %d in %.1fs", what,
                                self.url_of(rel), type(e).__name__, e, attempt, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, self.retry.max_backoff_s)
                    continue
                raise _map_error(e, what, self.url_of(rel)) from e

    # ------------------------------------------------------------------------------ reads

    def exists(self, rel: str) -> bool:
        return self.call("exists", rel, lambda: self.fs.exists(self.full(rel)))

    def isdir(self, rel: str = "") -> bool:
        return self.call("isdir", rel, lambda: self.fs.isdir(self.full(rel)))

    def size(self, rel: str) -> int:
        info = self.call("stat", rel, lambda: self.fs.info(self.full(rel)))
        if info.get("type") == "directory":
            raise StorageError(f"{self.url_of(rel)}: is a directory, expected a file", self.url_of(rel))
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
        """Raw bytes ``[start, end)`` of ``rel`` (no checksum; see :meth:`read_checked`)."""
        path = self.full(rel)
        if self.is_local:
            def local() -> bytes:
                with open(path, "rb") as f:
                    if start:
                        f.seek(start)
                    return f.read(-1 if end is None else end - (start or 0))
            return self.call("read", rel, local)
        return self.call("read", rel, lambda: self.fs.cat_file(path, start=start, end=end))

    def read_limited(self, rel: str, limit: int) -> bytes:
        """The whole of a small file, refusing one larger than ``limit`` before reading it."""
        n = self.size(rel)
        if n > limit:
            raise StorageError(f"{self.url_of(rel)}: {n} bytes, more than the {limit} allowed", self.url_of(rel))
        return self.read(rel)

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
        a, b = c0 * chunk_size, min(entry.size, c1 * chunk_size)
        data = self.read(rel, a, b)
        if len(data) != b - a:
            raise IntegrityError(f"{self.url_of(rel)}: truncated: bytes [{a}, {b}) returned "
                                 f"{len(data)} bytes (the manifest records {entry.size})")
        view = memoryview(data)
        for i in range(c0, c1):
            lo = (i - c0) * chunk_size
            got = crc32c(view[lo:lo + chunk_size])
            if got != entry.chunk_crc32c[i]:
                raise IntegrityError(
                    f"{self.url_of(rel)}: bytes [{i * chunk_size}, {min(entry.size, (i + 1) * chunk_size)}) "
                    f"fail their CRC32C check (recorded {entry.chunk_crc32c[i]:08x}, read {got:08x}); "
                    "the file is corrupted")
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

    def writer(self, rel: str, chunk_size: int) -> "StreamWriter":
        return StreamWriter(self, rel, chunk_size)

    def create_only(self, rel: str, data: bytes) -> None:
        """Write ``data`` at ``rel`` only if nothing is there: the commit point of a checkpoint.

        Local: write a temporary file, fsync, then ``link`` it into place (fails if the target
        exists), so the target is never seen half-written. Object stores: a single PUT with
        ``If-None-Match: *``. Raises :class:`CommitConflictError` if the object exists.
        """
        url = self.url_of(rel)
        path = self.full(rel)
        if self.is_local:
            with mapped_errors("commit", url):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    try:
                        os.link(tmp, path)
                    except FileExistsError as e:
                        raise CommitConflictError(f"{url} already exists: another save committed here "
                                                  "first; nothing was overwritten", url) from e
                    except OSError as e:
                        raise _map_error(e, "commit", url) from e
                    _fsync_dir(os.path.dirname(path))
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            return
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if protocol in ("s3", "s3a"):
            def put() -> None:
                self.fs.pipe_file(path, data, mode="create")
            try:
                self.call("commit", rel, put)
            except StorageError as e:
                cause = e.__cause__
                # moto raises FileExistsError; Ceph answers 412, which s3fs raises as OSError(EINVAL)
                if isinstance(cause, FileExistsError) or (
                        isinstance(cause, OSError) and cause.errno == errno.EINVAL):
                    raise CommitConflictError(f"{url} already exists: another save committed here "
                                              "first; nothing was overwritten", url) from cause
                raise
            return
        # other filesystems: best effort (check, then write)
        if self.exists(rel):
            raise CommitConflictError(f"{url} already exists: another save committed here first", url)
        self.call("write", rel, lambda: self.fs.pipe_file(path, data))

    def put(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically where the filesystem allows (local: rename)."""
        path = self.full(rel)
        if self.is_local:
            with mapped_errors("write", self.url_of(rel)):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                    _fsync_dir(os.path.dirname(path))
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            return
        self.call("write", rel, lambda: self.fs.pipe_file(path, data))

    def rm(self, rel: str, recursive: bool = False) -> None:
        try:
            self.call("remove", rel, lambda: self.fs.rm(self.full(rel), recursive=recursive))
        except NotFoundError:
            pass


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


class StreamWriter:
    """Sequential writer that computes the whole-file and per-chunk CRC32C as bytes go by.

    Use as a context manager: on an exception the write is aborted (local file removed, multipart
    upload aborted) instead of committed; :meth:`close` returns the size and checksums.
    """

    def __init__(self, storage: Storage, rel: str, chunk_size: int) -> None:
        self.storage, self.rel, self.chunk_size = storage, rel, chunk_size
        self.size = 0
        self.crc = 0
        self.chunks: list[int] = []
        self._chunk_crc = 0
        self._chunk_fill = 0
        self._closed = False
        path = storage.full(rel)
        if storage.is_local:
            def open_local() -> Any:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                return open(path, "wb")  # noqa: SIM115
            self._f = storage.call("open", rel, open_local)
        else:
            self._f = storage.call("open", rel, lambda: storage.fs.open(path, "wb"))

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        if not n:
            return
        self.crc = crc32c(view, self.crc)
        pos = 0
        while pos < n:
            take = min(n - pos, self.chunk_size - self._chunk_fill)
            self._chunk_crc = crc32c(view[pos:pos + take], self._chunk_crc)
            self._chunk_fill += take
            pos += take
            if self._chunk_fill == self.chunk_size:
                self.chunks.append(self._chunk_crc)
                self._chunk_crc, self._chunk_fill = 0, 0
        try:
            self._f.write(view)
        except Exception as e:  # noqa: BLE001
            raise _map_error(e, "write", self.storage.url_of(self.rel)) from e
        self.size += n

    def close(self) -> tuple[int, int, tuple[int, ...]]:
        """Flush, make durable (fsync locally; complete the upload remotely); return checksums."""
        if self._chunk_fill:
            self.chunks.append(self._chunk_crc)
            self._chunk_crc, self._chunk_fill = 0, 0
        f = self._f
        try:
            if self.storage.is_local:
                f.flush()
                os.fsync(f.fileno())
            f.close()
        except Exception as e:  # noqa: BLE001
            self.abort()
            raise _map_error(e, "close", self.storage.url_of(self.rel)) from e
        self._closed = True
        return self.size, self.crc, tuple(self.chunks)

    def abort(self) -> None:
        """Throw the partial write away; never commits a partial object."""
        if self._closed:
            return
        self._closed = True
        f = self._f
        try:
            if self.storage.is_local:
                f.close()
                os.unlink(self.storage.full(self.rel))
            else:
                discard = getattr(f, "discard", None)
                if discard is not None:
                    discard()
                    try:
                        f.closed = True  # keeps S3File.__del__ from completing the upload
                    except AttributeError:
                        pass  # io.BytesIO (memory://): read-only, and nothing to complete
                self.storage.rm(self.rel)
        except Exception:  # noqa: BLE001 - cleanup is best effort; the original error propagates
            log.warning("could not clean up partial %s", self.storage.url_of(self.rel), exc_info=True)

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()


@contextmanager
def mapped_errors(what: str, url: str) -> Iterator[None]:
    try:
        yield
    except ShardckptError:
        raise
    except OSError as e:
        raise _map_error(e, what, url) from e


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    return Storage(url, storage_options)


def iter_file_chunks(storage: Storage, rel: str, chunk_size: int, limit: int | None = None) -> Iterator[bytes]:
    """Sequential reads of ``rel`` in ``chunk_size`` pieces (bounded memory), up to ``limit`` bytes."""
    path = storage.full(rel)
    url = storage.url_of(rel)
    if storage.is_local:
        try:
            f = open(path, "rb")  # noqa: SIM115
        except OSError as e:
            raise _map_error(e, "open", url) from e
    else:
        f = storage.call("open", rel, lambda: storage.fs.open(path, "rb", block_size=chunk_size,
                                                               cache_type="none"))
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


# ------------------------------------------------------------------------ multipart uploads


@dataclass(frozen=True, slots=True)
class OpenUpload:
    key: str          # object path relative to the storage root
    upload_id: str
    initiated: float  # POSIX seconds


def list_open_uploads(storage: Storage, rel: str = "") -> list[OpenUpload]:
    """Multipart uploads started below ``rel`` and never completed or aborted (object stores only)."""
    protocol = storage.fs.protocol if isinstance(storage.fs.protocol, str) else storage.fs.protocol[0]
    if protocol not in ("s3", "s3a"):
        return []
    bucket, key, _ = storage.fs.split_path(storage.full(rel))
    prefix = key.rstrip("/") + "/" if key else ""
    root_key = storage.fs.split_path(storage.root)[1].rstrip("/")
    out: list[OpenUpload] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    for _ in range(10_000):  # pages; bounded
        resp = storage.call("list uploads", rel, lambda: storage.fs.call_s3("list_multipart_uploads", **kwargs))
        for u in resp.get("Uploads", []):
            k = u["Key"]
            relk = k[len(root_key) + 1:] if root_key and k.startswith(root_key + "/") else k
            out.append(OpenUpload(relk, u["UploadId"], u["Initiated"].timestamp()))
        if not resp.get("IsTruncated"):
            break
        kwargs.update(KeyMarker=resp.get("NextKeyMarker"), UploadIdMarker=resp.get("NextUploadIdMarker"))
    return out


def abort_upload(storage: Storage, upload: OpenUpload) -> None:
    bucket, key, _ = storage.fs.split_path(storage.full(upload.key))
    storage.call("abort upload", upload.key, lambda: storage.fs.call_s3(
        "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id))
