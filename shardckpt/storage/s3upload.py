"""S3 multipart uploads that shardckpt drives itself (:class:`S3Upload`), and the uploads left
open (:class:`OpenUpload`); used by :class:`~shardckpt.storage.s3.S3Backend`."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from collections.abc import Callable

from shardckpt.errors import DeadlineExceededError, StorageError
from shardckpt.storage.retry import NotFoundError, describe_error
from shardckpt.storage.s3copy import MIN_COPY, CopySource, copy_part, service_of, source_of

if TYPE_CHECKING:
    from shardckpt.storage.options import Tuning

T = TypeVar("T")


class UploadHost(Protocol):
    """What an upload needs of the backend that opens it (:class:`~shardckpt.storage.s3.S3Backend`):
    its s3fs filesystem and tuning, its retrying call, and its listing and abort of open uploads."""

    fs: Any
    tuning: Tuning

    def bucket_key(self, path: str) -> tuple[str, str]: ...

    def call(self, what: str, url: str, fn: Callable[[], T], deadline: float | None = None) -> T: ...

    def open_uploads(self, root: str, path: str, url: str, exact: bool) -> list[OpenUpload]: ...

    def abort_upload(self, path: str, url: str, upload_id: str) -> None: ...

log = logging.getLogger(__name__)


class S3Upload:
    """A multipart upload driven by shardckpt: parts retried alone, concurrent, abortable.

    The upload starts with the first full part; a file smaller than one part is a single PUT at
    close. Parts are uploaded on a small thread pool, at most ``concurrency`` in flight; a failed
    part fails the next ``write``/``close``, and the caller's abort aborts the upload.

    Bytes marked by :func:`~shardckpt.storage.s3copy.sourced` from an object on the same service
    become ``UploadPartCopy`` parts (:mod:`.s3copy`): the bytes pending before them are topped up
    to a valid part (at least 5 MiB) from the range's head, and a copy the server refuses is
    uploaded from the bytes in hand instead.
    """

    def __init__(self, backend: UploadHost, path: str, url: str) -> None:
        self.backend, self.url = backend, url
        self.bucket, self.key = backend.bucket_key(path)
        if not self.key:
            raise StorageError(f"{self.url}: not an object path")
        self.base_part = backend.tuning.part_size
        self.concurrency = max(1, backend.tuning.concurrency)
        self.buf = bytearray()  # the part being filled: its first ``fill`` bytes
        self.fill = 0
        self.upload_id: str | None = None
        self.create_tries = 0
        self.started = time.time()
        self.submitted = 0
        self.parts: dict[int, dict[str, Any]] = {}
        self.pending: deque[Future] = deque()
        self.spare: list[bytearray] = []  # one part buffer whose upload is done: filled again, no new pages
        self.pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.service = service_of(backend.fs)
        self.copied = 0  # bytes the server copied (parts sent as UploadPartCopy that succeeded)
        self.copy_refused: str | None = None  # why the server refused a copy (then no more are tried)

    def _part_size(self) -> int:
        # S3 allows 10,000 parts: grow the part size as the upload grows (all parts >= 5 MiB)
        return min(self.base_part << (self.submitted // 1000), 5 << 30)

    def write(self, view: memoryview) -> None:
        self._raise_failed()
        src = source_of(view) if self.copy_refused is None else None
        if src is not None and src.service == self.service and self._write_copied(view, src):
            return
        self._write_bytes(view)

    def _write_copied(self, view: memoryview, src: CopySource) -> bool:
        """``view`` (the bytes of ``src``) as a copy part where it can be one; False where not
        (nothing written then)."""
        need = max(0, MIN_COPY - self.fill) if self.fill else 0  # a pending part must be valid
        if len(view) - need < MIN_COPY or (need and len(self.buf) - self.fill < need):
            return False
        if need:
            self._write_bytes(view[:need])
        if self.fill:
            del self.buf[self.fill:]  # the pending part, cut short in place
            self._submit(self.buf)
            self.buf, self.fill = bytearray(), 0
        rest = CopySource(src.service, src.bucket, src.key, src.etag, src.start + need, src.end)
        self._submit(view[need:], rest)
        return True

    def _write_bytes(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        while pos < n:
            if not self.buf:  # one allocation per part, filled in place (no regrowth)
                size = self._part_size()
                with self._lock:
                    spare = self.spare.pop() if self.spare else None
                self.buf = spare if spare is not None and len(spare) == size else bytearray(size)
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
            out = self.backend.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self.create_tries += out.get("ResponseMetadata", {}).get("RetryAttempts", 0)  # botocore's
            return out["UploadId"]
        self.upload_id = self.backend.call("start upload", self.url, create)
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="shardckpt-upload")

    def _submit(self, data: Any, src: CopySource | None = None) -> None:
        if self.upload_id is None:
            self._create()
        self.submitted += 1
        number = self.submitted
        assert self.pool is not None
        if src is None:
            self.pending.append(self.pool.submit(self._upload_part, number, data))
        else:
            self.pending.append(self.pool.submit(self._copy_part, number, memoryview(data), src))
        while len(self.pending) >= self.concurrency:  # bound memory: wait for the oldest
            self.pending.popleft().result()
        self._raise_failed()

    def _upload_part(self, number: int, data: bytearray | bytes) -> None:
        out = self.backend.call(f"upload of part {number}", self.url, lambda: self.backend.fs.call_s3(
            "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
            PartNumber=number, Body=data))
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if "ChecksumSHA256" in out:
            part["ChecksumSHA256"] = out["ChecksumSHA256"]
        with self._lock:
            self.parts[number] = part
            if isinstance(data, bytearray) and len(data) == self.base_part and not self.spare:
                self.spare.append(data)

    def _copy_part(self, number: int, data: memoryview, src: CopySource) -> None:
        """Part ``number`` copied by the server from ``src``, kept only if the part's ETag (the
        MD5 of what the server copied) is the MD5 of ``data`` (the same bytes, read and
        checked); else, or where the server refuses the copy, uploaded from ``data``."""
        if self.copy_refused is None:
            assert self.upload_id is not None
            why = None
            try:
                part = copy_part(self.backend, self.bucket, self.key, self.upload_id, number, src, self.url)
            except DeadlineExceededError:
                raise  # the service is failing: an upload would fail the same way
            except StorageError as e:
                why = f"the server refused it: {describe_error(e.__cause__ or e)}"
            else:
                if part["ETag"].strip('"') == hashlib.md5(data).hexdigest():
                    with self._lock:
                        self.parts[number] = part
                        self.copied += src.end - src.start
                    return
                why = "the server's copy is not the bytes that were read (the source changed)"
            with self._lock:
                if self.copy_refused is None:
                    log.info("%s: no server-side copy from s3://%s/%s (%s); uploading the bytes "
                             "instead", self.url, src.bucket, src.key, why)
                    self.copy_refused = why
        self._upload_part(number, bytes(data))

    def _raise_failed(self) -> None:
        for f in self.pending:
            if f.done() and f.exception() is not None:
                f.result()

    def close(self, size: int) -> None:
        fs = self.backend.fs
        tail = self.buf[:self.fill] if self.fill < len(self.buf) else self.buf
        self.buf, self.fill = bytearray(), 0
        if self.upload_id is None:
            self.backend.call("write", self.url, lambda: fs.call_s3(
                "put_object", Bucket=self.bucket, Key=self.key, Body=tail))
            return
        if tail:
            self._submit(tail)
        while self.pending:
            self.pending.popleft().result()
        parts = [self.parts[i] for i in range(1, self.submitted + 1)]
        try:
            self.backend.call("complete upload", self.url, lambda: fs.call_s3(
                "complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                UploadId=self.upload_id, MultipartUpload={"Parts": parts}))
        except NotFoundError:
            # NoSuchUpload on a retry (ours or botocore's): did a first try complete it, its
            # answer lost? Then the object's multipart ETag is the one our parts make.
            if not self._completed_as(parts, size):
                raise
        self.upload_id = None
        self._shutdown()
        if self.copied:
            log.info("%s: %d of %d bytes copied by the server (UploadPartCopy)", self.url, self.copied, size)
        if self.create_tries > 1:
            try:
                self._abort_orphans()
            except StorageError as e:  # the file is complete; `shardckpt clean` sweeps the rest
                log.warning("%s: could not abort a stray upload: %s", self.url, e)

    def _completed_as(self, parts: list[dict[str, Any]], size: int) -> bool:
        try:
            info = self.backend.call("stat", self.url, lambda: self.backend.fs.call_s3(
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
                self.backend.call("abort upload", self.url, lambda: self.backend.fs.call_s3(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id))
            except NotFoundError:
                pass
            log.info("aborted the multipart upload of %s", self.url)
        if self.create_tries > 1:  # a lost answer may have left an upload we never heard of
            self._abort_orphans()

    def _abort_orphans(self) -> None:
        path, url = f"{self.bucket}/{self.key}", f"s3://{self.bucket}/{self.key}"
        for u in self.backend.open_uploads(self.bucket, path, url, exact=True):
            if u.initiated >= self.started - 60:
                self.backend.abort_upload(f"{self.bucket}/{u.key}", f"s3://{self.bucket}/{u.key}",
                                          u.upload_id)

    def _shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


@dataclass(frozen=True, slots=True)
class OpenUpload:
    key: str          # object path relative to the storage root
    upload_id: str
    initiated: float  # POSIX seconds
