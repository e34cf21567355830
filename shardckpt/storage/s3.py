"""S3 specifics: client defaults, multipart uploads shardckpt drives itself, the create-only commit.

Every call goes through :meth:`Storage.call`, so each request (a part, a commit, a listing page)
is retried alone under the storage's deadline and its errors are mapped like any other.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardckpt.errors import CommitConflictError, StorageError
from shardckpt.storage.retry import NotFoundError, _is_precondition_failed

if TYPE_CHECKING:
    from shardckpt.storage.core import Storage

log = logging.getLogger(__name__)

#: botocore settings for s3 unless the user gives their own (merged key by key).
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "retries": {"mode": "standard", "total_max_attempts": 2},
    "connect_timeout": 10,
    "read_timeout": 30,
    "max_pool_connections": 32,
}
S3FS_RETRIES = 1  # s3fs's own retry loop (its default is 5)


def fill_s3_defaults(opts: dict[str, Any]) -> int:
    """Fill the s3 defaults into fsspec options ``opts`` (in place); return s3fs's retry count."""
    config = dict(S3_CONFIG_DEFAULTS)
    config.update(opts.get("config_kwargs") or {})
    opts["config_kwargs"] = config
    opts.setdefault("use_listings_cache", False)  # other processes write here too
    return int(opts.pop("retries", S3FS_RETRIES))  # not an S3FileSystem argument


def put_if_absent(storage: Storage, rel: str, data: bytes, conflict: CommitConflictError) -> None:
    """One PUT with ``If-None-Match: *``; raises ``conflict`` if another object is there."""
    bucket, key = storage.bucket_key(rel)
    try:
        storage.call("commit", rel, lambda: storage.fs.call_s3(
            "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"))
    except StorageError as e:
        if not _is_precondition_failed(e.__cause__):
            raise
        # A retry (ours or botocore's) after a PUT that landed with its answer lost meets
        # our own object: the manifest names a unique save id, so equal bytes are ours.
        if _holds(storage, rel, data):
            return
        raise conflict from e.__cause__


def _holds(storage: Storage, rel: str, data: bytes) -> bool:
    try:
        return storage.size(rel) == len(data) and storage.read(rel) == data
    except StorageError:
        return False


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
        bucket_root = copy.copy(self.storage)  # same filesystem and options, rooted at the bucket
        bucket_root.root, bucket_root.url = self.bucket, f"s3://{self.bucket}"
        for u in list_open_uploads(bucket_root, self.key, exact=True):
            if u.initiated >= self.started - 60:
                abort_upload(bucket_root, u)

    def _shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


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
