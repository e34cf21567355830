"""Storage over fsspec: the only module that touches files or object stores.

Paths above this layer are strings relative to a checkpoint's root URL (``str``, never ``Path``:
``Path`` mangles ``s3://``). Every failure becomes a :class:`~shardckpt.errors.StorageError`
(original exception as ``__cause__``) whose one-line message names the object; every checked read
verifies CRC32C per chunk, ranged reads included.

Object stores (``s3://``; see :data:`S3_CONFIG_DEFAULTS`):

* **One deadline.** botocore and s3fs each retry, and their layers multiply (5 x 5 tries by
  default). Here botocore gets 2 tries per request and s3fs 1, with bounded connect/read timeouts;
  :meth:`Storage.call` retries transient failures (5xx, throttling, resets, timeouts, truncated
  bodies) with capped, jittered backoff until one deadline per operation (a ranged GET, one
  multipart part, a commit): ``storage_options={"shardckpt_deadline_s": 120}``, else the
  environment variable ``SHARDCKPT_DEADLINE_S``, else 120 s. A user's own ``config_kwargs`` and
  ``retries`` (s3fs's count) override the defaults key by key.
* **Reads** are ranged GETs of whole checksum chunks only; a range larger than ``range_piece`` is
  split into pieces fetched concurrently, and each failed piece is retried alone. A chunk whose
  CRC32C fails is read once more before the read is declared corrupt (a bad transfer is not a bad
  object). Nothing is staged on local disk.
* **Writes** stream as multipart uploads that shardckpt drives itself (not ``fs.open("wb")``,
  whose ``__exit__`` on an exception completes the partial object): parts of ``part_size`` bytes
  go up concurrently, at most ``concurrency`` in flight, and each part is retried as a unit (it is
  still in memory) under the deadline. A file whose producer or any part fails is aborted: the
  multipart upload is aborted and nothing becomes visible. Memory per writer is at most
  ``(concurrency + 1) x part_size``. Files smaller than a part are one PUT.
* **Commit** is a PUT with ``If-None-Match: *``. moto answers a conflict with FileExistsError,
  Ceph with 412 PreconditionFailed (OSError(EINVAL)); both become
  :class:`~shardckpt.errors.CommitConflictError`. If a retried commit meets a conflict, the object
  is read back: our own bytes (a first try that landed but whose answer was lost) are success.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import crc32c as _crc32c

from shardckpt.errors import (
    CommitConflictError, ConfigError, IntegrityError, ShardckptError, StorageError,
)
from shardckpt.manifest import FileEntry

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
DEADLINE_ENV = "SHARDCKPT_DEADLINE_S"
#: botocore settings for s3 unless the user gives their own (merged key by key).
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "retries": {"mode": "standard", "total_max_attempts": 2},
    "connect_timeout": 10,
    "read_timeout": 30,
    "max_pool_connections": 32,
}
S3FS_RETRIES = 1  # s3fs's own retry loop (its default is 5)
DEFAULT_PART_SIZE = 8 * MiB
DEFAULT_CONCURRENCY = 4


def crc32c(data: Any, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


class NotFoundError(StorageError):
    """The object does not exist."""


class DeadlineExceededError(StorageError):
    """A transient failure persisted until the retry deadline."""


# --------------------------------------------------------------------------------- options


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """One overall deadline per operation, capped exponential backoff, an explicit retryable list."""

    deadline_s: float = 120.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Tuning:
    """Transfer sizes for object stores (``shardckpt_part_size``, ``shardckpt_concurrency``)."""

    part_size: int = DEFAULT_PART_SIZE  # multipart part; doubles every 1000 parts (10,000 max)
    concurrency: int = DEFAULT_CONCURRENCY  # parts in flight per file; range pieces per read
    range_piece: int = DEFAULT_PART_SIZE    # ranged reads larger than this are split


_OWN = ("shardckpt_deadline_s", "shardckpt_part_size", "shardckpt_concurrency")


def _positive(options: Mapping[str, Any], key: str, cast: Callable[[Any], T]) -> T | None:
    if key not in options or options[key] is None:
        return None
    try:
        value = cast(options[key])
        if value > 0:  # type: ignore[operator]
            return value
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"storage option {key}={options[key]!r}: expected a positive number")


def split_options(url: str, options: Mapping[str, Any] | None,
                  ) -> tuple[dict[str, Any], RetryPolicy, Tuning, int | None]:
    """(fsspec options, retry policy, tuning, s3fs retries) from a user's ``storage_options``.

    shardckpt's own keys (``shardckpt_*``) are popped; for s3 the defaults above are filled in.
    """
    opts = storage_options_from_env(url, options)
    own = {k: opts.pop(k) for k in _OWN if k in opts}
    deadline = _positive(own, "shardckpt_deadline_s", float)
    if deadline is None and os.environ.get(DEADLINE_ENV, "").strip():
        deadline = _positive({DEADLINE_ENV: os.environ[DEADLINE_ENV]}, DEADLINE_ENV, float)
    retry = RetryPolicy(deadline) if deadline is not None else RetryPolicy()
    part = _positive(own, "shardckpt_part_size", int)
    if part is not None and part < 5 * MiB:
        raise ConfigError(f"storage option shardckpt_part_size={part}: S3 parts must be >= 5 MiB")
    tuning = Tuning(part or DEFAULT_PART_SIZE,
                    _positive(own, "shardckpt_concurrency", int) or DEFAULT_CONCURRENCY)
    s3fs_retries = None
    if url.startswith(("s3://", "s3a://")):
        config = dict(S3_CONFIG_DEFAULTS)
        config.update(opts.get("config_kwargs") or {})
        opts["config_kwargs"] = config
        opts.setdefault("use_listings_cache", False)  # other processes write here too
        s3fs_retries = int(opts.pop("retries", S3FS_RETRIES))  # not an S3FileSystem argument
    return opts, retry, tuning, s3fs_retries


def storage_options_from_env(url: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """fsspec options for ``url``: the user's, plus an S3 endpoint from ``AWS_ENDPOINT_URL(_S3)``.

    Credentials (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``) are read by
    botocore itself.
    """
    opts = dict(options or {})
    if url.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        ck = dict(opts.get("client_kwargs") or {})
        if endpoint and "endpoint_url" not in ck and "endpoint_url" not in opts:
            ck["endpoint_url"] = endpoint
        if ck:
            opts["client_kwargs"] = ck
    return opts


# --------------------------------------------------------------------------------- errors


_RETRYABLE_ERRNO = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.EREMOTEIO,
                    errno.ECONNREFUSED, errno.EPIPE, errno.ECONNABORTED}
_RETRYABLE_NAMES = {
    # botocore / aiohttp / asyncio transport errors, matched by name so neither is imported here
    "HTTPClientError", "ConnectionClosedError", "EndpointConnectionError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "ResponseParserError",
    "FlexibleChecksumError", "ClientPayloadError", "ClientConnectionError", "ServerDisconnectedError",
    "ClientConnectorError", "ClientOSError", "ServerTimeoutError", "TimeoutError", "ProtocolError",
    "ContentLengthError",
}
_NEVER_RETRY = {"FileExpired", "NoCredentialsError", "ParamValidationError", "PartialCredentialsError"}
_RETRYABLE_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                    "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
                    "ConditionalRequestConflict", "OperationAborted"}


def _response(e: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError, or of the one s3fs translated."""
    for x in (e, e.__cause__):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict):
            code = str(resp.get("Error", {}).get("Code", ""))
            status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code, status
    return "", 0


def _is_retryable(e: BaseException) -> bool:
    names = {cls.__name__ for cls in type(e).__mro__}
    if names & _NEVER_RETRY or isinstance(e, (FileNotFoundError, PermissionError, FileExistsError,
                                              IsADirectoryError, NotADirectoryError)):
        return False
    if names & _RETRYABLE_NAMES or isinstance(e, (ConnectionError, TimeoutError)):
        return True
    code, status = _response(e)
    if code in _RETRYABLE_CODES or status >= 500 or status == 429:
        return True
    if isinstance(e, OSError):
        return e.errno in _RETRYABLE_ERRNO
    return False


def _is_precondition_failed(e: BaseException | None) -> bool:
    """A create-only write found the object: FileExistsError (moto), 412 (Ceph, AWS)."""
    if e is None:
        return False
    if isinstance(e, FileExistsError):
        return True
    code, status = _response(e)
    return code in ("PreconditionFailed", "412") or status == 412


def _describe(e: BaseException) -> str:
    """One line: exception type, message, and the S3 error code when there is one."""
    text = " ".join(str(e).split())[:300] or repr(e)
    code, status = _response(e)
    extra = f" ({code}, HTTP {status})" if code and code not in text else ""
    return f"{type(e).__name__}: {text}{extra}"


def _map_error(e: BaseException, what: str, url: str, attempts: int = 1, elapsed: float = 0.0,
               deadline: float | None = None) -> StorageError:
    if isinstance(e, FileNotFoundError):
        return NotFoundError(f"{url}: not found ({what})", url)
    if isinstance(e, PermissionError):
        return StorageError(f"{url}: permission denied ({what}): {_describe(e)}", url)
    if attempts > 1 and deadline is not None:
        return DeadlineExceededError(
            f"{url}: {what} failed after {attempts} attempts in {elapsed:.1f} s (deadline "
            f"{deadline:g} s; set shardckpt_deadline_s or {DEADLINE_ENV}): {_describe(e)}", url)
    return StorageError(f"{url}: {what} failed: {_describe(e)}", url)


# --------------------------------------------------------------------------------- storage


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
        if s3fs_retries is not None:
            self.fs.retries = s3fs_retries
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.retry = retry or policy
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.is_local = protocol in ("file", "local")
        self.is_s3 = protocol in ("s3", "s3a")

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
        t0 = time.monotonic()
        end = deadline if deadline is not None else t0 + self.retry.deadline_s
        backoff = self.retry.initial_backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except ShardckptError:
                raise
            except Exception as e:  # noqa: BLE001 - mapped below, never swallowed
                pause = backoff * (0.5 + random.random() / 2)
                if _is_retryable(e) and time.monotonic() + pause < end:
                    log.info("%s of %s failed (%s); retry %d in %.2fs", what, self.url_of(rel),
                             _describe(e), attempt, pause)
                    time.sleep(pause)
                    backoff = min(backoff * 2, self.retry.max_backoff_s)
                    continue
                raise _map_error(e, what, self.url_of(rel), attempt, time.monotonic() - t0,
                                 self.retry.deadline_s if _is_retryable(e) else None) from e

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
        """Raw bytes ``[start, end)`` of ``rel`` (no checksum; see :meth:`read_checked`).

        On an async object store a range larger than ``tuning.range_piece`` is fetched as
        concurrent ranged GETs; a failed piece is retried alone, all under one deadline.
        """
        path = self.full(rel)
        if self.is_local:
            def local() -> bytes:
                with open(path, "rb") as f:
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

    def read_limited(self, rel: str, limit: int) -> bytes:
        """The whole of a small file, refusing one larger than ``limit`` before reading it."""
        n = self.size(rel)
        if n > limit:
            raise StorageError(f"{self.url_of(rel)}: {n} bytes, more than the {limit} allowed", self.url_of(rel))
        return self.read(rel)

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

    def writer(self, rel: str, chunk_size: int) -> "StreamWriter":
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
                        raise conflict from e
                    except OSError as e:
                        raise _map_error(e, "commit", url) from e
                    _fsync_dir(os.path.dirname(path))
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            return
        if self.is_s3:
            bucket, key = self.bucket_key(rel)
            try:
                self.call("commit", rel, lambda: self.fs.call_s3(
                    "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"))
            except StorageError as e:
                if not _is_precondition_failed(e.__cause__):
                    raise
                # A retry (ours or botocore's) after a PUT that landed with its answer lost meets
                # our own object: the manifest names a unique save id, so equal bytes are ours.
                if self._holds(rel, data):
                    return
                raise conflict from e.__cause__
            return
        # other filesystems: best effort (check, then write)
        if self.exists(rel):
            raise conflict
        self.call("write", rel, lambda: self.fs.pipe_file(path, data))

    def _holds(self, rel: str, data: bytes) -> bool:
        try:
            return self.size(rel) == len(data) and self.read(rel) == data
        except StorageError:
            return False

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


def _first_bad_chunk(view: memoryview, entry: FileEntry, chunk_size: int, c0: int,
                     c1: int) -> tuple[int, int] | None:
    """(index, CRC read) of the first chunk in ``view`` (chunks ``[c0, c1)``) that fails."""
    for i in range(c0, c1):
        lo = (i - c0) * chunk_size
        got = crc32c(view[lo:lo + chunk_size])
        if got != entry.chunk_crc32c[i]:
            return i, got
    return None


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


# ---------------------------------------------------------------------------------- writers


class StreamWriter:
    """Sequential writer that computes the whole-file and per-chunk CRC32C as bytes go by.

    Use as a context manager: on an exception the write is aborted (local file removed, multipart
    upload aborted) instead of committed; :meth:`close` returns the size and checksums. A writer
    that is neither closed nor aborted never commits anything either: on S3 its upload stays open
    until aborted here or by ``shardckpt clean``.
    """

    def __init__(self, storage: Storage, rel: str, chunk_size: int) -> None:
        self.storage, self.rel, self.chunk_size = storage, rel, chunk_size
        self.size = 0
        self.crc = 0
        self.chunks: list[int] = []
        self._chunk_crc = 0
        self._chunk_fill = 0
        self._closed = False
        if storage.is_local:
            self._sink: Any = _LocalSink(storage, rel)
        elif storage.is_s3:
            self._sink = _S3Upload(storage, rel)
        else:
            self._sink = _FsspecSink(storage, rel)

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        if not n:
            return
        if self._closed:
            raise StorageError(f"{self.storage.url_of(self.rel)}: write after close or abort")
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
        self._sink.write(view)
        self.size += n

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
                        self.storage.url_of(self.rel), _describe(e))

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()


class _LocalSink:
    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage, self.rel, self.path = storage, rel, storage.full(rel)

        def open_local() -> Any:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            return open(self.path, "wb")  # noqa: SIM115
        self.f = storage.call("open", rel, open_local)

    def write(self, view: memoryview) -> None:
        with mapped_errors("write", self.storage.url_of(self.rel)):
            self.f.write(view)

    def close(self, size: int) -> None:
        with mapped_errors("close", self.storage.url_of(self.rel)):
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


class _FsspecSink:
    """Any other fsspec filesystem (``memory://``, ...) through ``fs.open("wb")``.

    fsspec files commit on ``close()`` and on ``__del__``; abort discards, then marks the file
    closed *before* anything else can fail, so neither path can commit a partial object.
    """

    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage, self.rel = storage, rel
        self.f = storage.call("open", rel, lambda: storage.fs.open(storage.full(rel), "wb"))

    def write(self, view: memoryview) -> None:
        try:
            self.f.write(view)
        except Exception as e:  # noqa: BLE001
            raise _map_error(e, "write", self.storage.url_of(self.rel)) from e

    def close(self, size: int) -> None:
        try:
            self.f.close()
        except Exception as e:  # noqa: BLE001
            raise _map_error(e, "close", self.storage.url_of(self.rel)) from e

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
        self.storage.rm(self.rel)


class _S3Upload:
    """A multipart upload driven by shardckpt: parts retried alone, concurrent, abortable.

    The upload starts with the first full part; a file smaller than one part is a single PUT at
    close. Parts are uploaded on a small thread pool, at most ``concurrency`` in flight; a failed
    part fails the next ``write``/``close``, and the caller's abort aborts the upload.
    """

    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage, self.rel = storage, rel
        self.url = storage.url_of(rel)
        self.bucket, self.key = storage.bucket_key(rel)
        if not self.key:
            raise StorageError(f"{self.url}: not an object path")
        self.base_part = storage.tuning.part_size
        self.concurrency = max(1, storage.tuning.concurrency)
        self.buf = bytearray()  # the part being filled: its first ``fill`` bytes
        self.fill = 0
        self.upload_id: str | None = None
        self.create_tries = 0
        self.started = time.time()
        self.submitted = 0
        self.parts: dict[int, dict[str, Any]] = {}
        self.pending: deque[Future] = deque()
        self.pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _part_size(self) -> int:
        # S3 allows 10,000 parts: grow the part size as the upload grows (all parts >= 5 MiB)
        return min(self.base_part << (self.submitted // 1000), 5 << 30)

    def write(self, view: memoryview) -> None:
        self._raise_failed()
        pos, n = 0, len(view)
        while pos < n:
            if not self.buf:  # one allocation per part, filled in place (no regrowth)
                self.buf = bytearray(self._part_size())
            take = min(n - pos, len(self.buf) - self.fill)
            self.buf[self.fill:self.fill + take] = view[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == len(self.buf):
                self._submit(self.buf)
                self.buf, self.fill = bytearray(), 0

    def _create(self) -> None:
        def create() -> str:
            self.create_tries += 1
            out = self.storage.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self.create_tries += out.get("ResponseMetadata", {}).get("RetryAttempts", 0)  # botocore's
            return out["UploadId"]
        self.upload_id = self.storage.call("start upload", self.rel, create)
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="shardckpt-upload")

    def _submit(self, data: bytearray) -> None:
        if self.upload_id is None:
            self._create()
        self.submitted += 1
        number = self.submitted
        assert self.pool is not None
        self.pending.append(self.pool.submit(self._upload_part, number, data))
        while len(self.pending) >= self.concurrency:  # bound memory: wait for the oldest
            self.pending.popleft().result()
        self._raise_failed()

    def _upload_part(self, number: int, data: bytearray) -> None:
        out = self.storage.call(f"upload of part {number}", self.rel, lambda: self.storage.fs.call_s3(
            "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
            PartNumber=number, Body=data))
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if "ChecksumSHA256" in out:
            part["ChecksumSHA256"] = out["ChecksumSHA256"]
        with self._lock:
            self.parts[number] = part

    def _raise_failed(self) -> None:
        for f in self.pending:
            if f.done() and f.exception() is not None:
                f.result()

    def close(self, size: int) -> None:
        fs = self.storage.fs
        tail = self.buf[:self.fill] if self.fill < len(self.buf) else self.buf
        self.buf, self.fill = bytearray(), 0
        if self.upload_id is None:
            self.storage.call("write", self.rel, lambda: fs.call_s3(
                "put_object", Bucket=self.bucket, Key=self.key, Body=tail))
            return
        if tail:
            self._submit(tail)
        while self.pending:
            self.pending.popleft().result()
        parts = [self.parts[i] for i in range(1, self.submitted + 1)]
        try:
            self.storage.call("complete upload", self.rel, lambda: fs.call_s3(
                "complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                UploadId=self.upload_id, MultipartUpload={"Parts": parts}))
        except NotFoundError:
            # NoSuchUpload on a retry (ours or botocore's): did a first try complete it, its
            # answer lost? Then the object's multipart ETag is the one our parts make.
            if not self._completed_as(parts, size):
                raise
        self.upload_id = None
        self._shutdown()
        if self.create_tries > 1:
            try:
                self._abort_orphans()
            except StorageError as e:  # the file is complete; `shardckpt clean` sweeps the rest
                log.warning("%s: could not abort a stray upload: %s", self.url, e)

    def _completed_as(self, parts: list[dict[str, Any]], size: int) -> bool:
        import hashlib

        try:
            info = self.storage.call("stat", self.rel, lambda: self.storage.fs.call_s3(
                "head_object", Bucket=self.bucket, Key=self.key))
        except StorageError:
            return False
        digest = hashlib.md5(b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts))
        etag = f'"{digest.hexdigest()}-{len(parts)}"'
        return info.get("ContentLength") == size and info.get("ETag") == etag

    def abort(self) -> None:
        for f in self.pending:
            f.cancel()
        wait(list(self.pending))  # running parts end (bounded by the deadline) before the abort
        self.pending.clear()
        self._shutdown()
        self.buf, self.fill = bytearray(), 0
        if self.upload_id is not None:
            upload_id, self.upload_id = self.upload_id, None
            try:
                self.storage.call("abort upload", self.rel, lambda: self.storage.fs.call_s3(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id))
            except NotFoundError:
                pass
            log.info("aborted the multipart upload of %s", self.url)
        if self.create_tries > 1:  # a lost answer may have left an upload we never heard of
            self._abort_orphans()

    def _abort_orphans(self) -> None:
        bucket_root = Storage.__new__(Storage)
        bucket_root.__dict__.update(self.storage.__dict__)
        bucket_root.root, bucket_root.url = self.bucket, f"s3://{self.bucket}"
        for u in list_open_uploads(bucket_root, self.key, exact=True):
            if u.initiated >= self.started - 60:
                abort_upload(bucket_root, u)

    def _shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


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
    """Sequential reads of ``rel`` in ``chunk_size`` pieces (bounded memory), up to ``limit`` bytes.

    Remote: ranged reads of several chunks at a time (retried), the next read ahead while the
    caller checks the current one; memory is about two such reads.
    """
    path = storage.full(rel)
    url = storage.url_of(rel)
    if storage.is_local:
        try:
            f = open(path, "rb")  # noqa: SIM115
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


# ------------------------------------------------------------------------ multipart uploads


@dataclass(frozen=True, slots=True)
class OpenUpload:
    key: str          # object path relative to the storage root
    upload_id: str
    initiated: float  # POSIX seconds


def list_open_uploads(storage: Storage, rel: str = "", exact: bool = False) -> list[OpenUpload]:
    """Multipart uploads started below ``rel`` (``exact``: of the object ``rel``) and never
    completed or aborted (object stores only)."""
    if not storage.is_s3:
        return []
    bucket, key = storage.bucket_key(rel)
    prefix = key if exact else (key.rstrip("/") + "/" if key else "")
    root_key = storage.fs.split_path(storage.root)[1].rstrip("/")
    out: list[OpenUpload] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    for _ in range(10_000):  # pages; bounded
        resp = storage.call("list uploads", rel, lambda: storage.fs.call_s3("list_multipart_uploads", **kwargs))
        for u in resp.get("Uploads", []):
            k = u["Key"]
            if exact and k != key:
                continue
            relk = k[len(root_key) + 1:] if root_key and k.startswith(root_key + "/") else k
            out.append(OpenUpload(relk, u["UploadId"], u["Initiated"].timestamp()))
        if not resp.get("IsTruncated"):
            break
        kwargs.update(KeyMarker=resp.get("NextKeyMarker"), UploadIdMarker=resp.get("NextUploadIdMarker"))
    return out


def abort_upload(storage: Storage, upload: OpenUpload) -> None:
    bucket, key = storage.bucket_key(upload.key)
    try:
        storage.call("abort upload", upload.key, lambda: storage.fs.call_s3(
            "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id))
    except NotFoundError:
        pass  # already gone
