"""S3: the backend of ``s3://`` locations: its options and client defaults, its error codes,
multipart uploads shardckpt drives itself (:mod:`.s3upload`), the conditional writes (``If-None-Match: *`` to
create, ``If-Match: <etag>`` to replace), and the uploads left open.

Every call goes through the backend's retried :meth:`~shardckpt.storage.backends.Backend.call`, so
each request (a part, a commit, a listing page) is retried alone under the deadline, as
:meth:`S3Backend.classify` judges its errors, and its errors are mapped like any other.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, ClassVar
from collections.abc import Collection, Mapping

from shardckpt.errors import StorageError
from shardckpt.storage.backends import Backend, changed_error, conflict_error
from shardckpt.storage.options import BackendOptions, fsspec_option_names
from shardckpt.storage.retry import (
    PERMANENT_NAMES, TRANSIENT_NAMES, NotFoundError, Verdict, classify, error_response,
)
from shardckpt.storage.s3upload import OpenUpload, S3Upload
from shardckpt.storage.writer import Sink

log = logging.getLogger(__name__)

#: botocore settings for s3 unless the user gives their own (merged key by key).
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "retries": {"mode": "standard", "total_max_attempts": 2},
    "connect_timeout": 10,
    "read_timeout": 30,
    "max_pool_connections": 32,
}
S3FS_RETRIES = 1  # s3fs's own retry loop (its default is 5)

#: botocore's transport errors, on top of the HTTP stack's (retried).
_TRANSIENT = TRANSIENT_NAMES | {
    "HTTPClientError", "ConnectionClosedError", "EndpointConnectionError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "ResponseParserError",
    "FlexibleChecksumError",
}
#: botocore's errors of a client that no retry mends.
_PERMANENT = PERMANENT_NAMES | {"NoCredentialsError", "ParamValidationError", "PartialCredentialsError"}
#: S3 error codes of a busy or briefly failing service (retried).
_TRANSIENT_CODES = frozenset({
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
    "ThrottlingException", "TooManyRequests", "RequestLimitExceeded", "ConditionalRequestConflict",
    "OperationAborted",
})


def fill_s3_defaults(opts: dict[str, Any]) -> int:
    """Fill the s3 defaults into fsspec options ``opts`` (in place); return s3fs's retry count."""
    config = dict(S3_CONFIG_DEFAULTS)
    config.update(opts.get("config_kwargs") or {})
    opts["config_kwargs"] = config
    opts.setdefault("use_listings_cache", False)  # other processes write here too
    return int(opts.pop("retries", S3FS_RETRIES))  # not an S3FileSystem argument


def _is_precondition_failed(e: BaseException | None) -> bool:
    """A conditional write found another object: FileExistsError (moto's create-only), 412
    PreconditionFailed (Ceph, AWS; s3fs raises OSError(EINVAL) with the ClientError as cause)."""
    if e is None:
        return False
    if isinstance(e, FileExistsError):
        return True
    code, status = error_response(e)
    return code in ("PreconditionFailed", "412") or status == 412


class S3Backend(Backend):
    """An S3 (or S3-compatible) bucket through s3fs."""

    schemes: ClassVar[tuple[str, ...]] = ("s3", "s3a")
    #: The server matched If-Match only without the ETag's quotes (Ceph RGW 16).
    _unquoted_if_match = False

    @classmethod
    def known_options(cls) -> Collection[str]:
        """s3fs's, those its leftover keywords go to (aiobotocore's session: ``profile``), and
        ``retries``."""
        import inspect

        import s3fs
        from aiobotocore.session import AioSession

        session = [p.name for p in inspect.signature(AioSession.__init__).parameters.values()
                   if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
        return fsspec_option_names(s3fs.S3FileSystem) | {"retries", *session}

    @classmethod
    def parse_options(cls, raw: Mapping[str, Any]) -> BackendOptions:
        """Also fills :data:`S3_CONFIG_DEFAULTS` (the user's keys win) and takes ``retries``
        (s3fs's own count, :data:`S3FS_RETRIES` by default)."""
        parsed = super().parse_options(raw)
        retries = fill_s3_defaults(parsed.fs)
        return dataclasses.replace(parsed, extra={"s3fs_retries": retries})

    @classmethod
    def options_from_env(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        """An endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` unless one is given."""
        opts = dict(raw)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        ck = dict(opts.get("client_kwargs") or {})
        if endpoint and "endpoint_url" not in ck and "endpoint_url" not in opts:
            ck["endpoint_url"] = endpoint
        if ck:
            opts["client_kwargs"] = ck
        return opts

    @classmethod
    def fresh_listings(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {"use_listings_cache": False, **raw}

    @classmethod
    def open(cls, url: str, options: BackendOptions) -> tuple[Backend, str]:
        backend, root = super().open(url, options)
        backend.fs.retries = options.extra.get("s3fs_retries", S3FS_RETRIES)
        return backend, root

    def classify(self, error: BaseException) -> Verdict:
        """botocore's transport errors and S3's throttling and 5xx codes are transient."""
        return classify(error, _TRANSIENT, _PERMANENT, _TRANSIENT_CODES)

    def location(self, path: str) -> tuple[str, str]:
        return ("s3", super().location(path)[1])

    def bucket_key(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def sink(self, path: str, url: str) -> Sink:
        return S3Upload(self, path, url)

    def put(self, path: str, url: str, data: bytes) -> None:
        bucket, key = self.bucket_key(path)
        self.call("write", url, lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data))

    def create_only(self, path: str, url: str, data: bytes) -> None:
        """One PUT with ``If-None-Match: *``; :class:`CommitConflictError` if another object is
        there."""
        bucket, key = self.bucket_key(path)
        try:
            self.call("commit", url, lambda: self.fs.call_s3(
                "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"))
        except StorageError as e:
            if not _is_precondition_failed(e.__cause__):
                raise
            # A retry (ours or botocore's) after a PUT that landed with its answer lost meets
            # our own object: the manifest names a unique save id, so equal bytes are ours.
            if self._holds(path, url, data):
                return
            raise conflict_error(url) from e.__cause__

    def replace_if(self, path: str, url: str, data: bytes, expected: bytes) -> None:
        """One PUT with ``If-Match: <etag>``, the ETag of the very GET that found ``expected``
        there: a writer that replaced the object in between makes it fail (412), and nothing is
        replaced. A retry that meets our own object (a first try landed, its answer lost) is
        success. Ceph RGW compares the ETag without its quotes: a 412 while the object is
        unchanged makes the next try send it unquoted (and remembers that). A server that refuses
        every spelling while the object is unchanged gets a plain PUT after the check."""
        bucket, key = self.bucket_key(path)
        etag = self._etag_if_holds(bucket, key, url, expected)
        if etag is None:
            raise changed_error(url)
        spellings = [etag, etag.strip('"')] if etag.startswith('"') else [etag]
        if self._unquoted_if_match:
            spellings.reverse()
        for tag in spellings:
            def put(tag: str = tag) -> Any:
                return self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=tag)
            try:
                self.call("commit", url, put)
                self._unquoted_if_match = not tag.startswith('"')
                return
            except StorageError as e:
                if not (isinstance(e, NotFoundError) or _is_precondition_failed(e.__cause__)):
                    raise
                if self._holds(path, url, data):
                    return
                if self._etag(bucket, key, url) != etag:
                    raise changed_error(url) from e.__cause__
        log.warning("%s: the server refused If-Match with the object's own ETag; replacing it "
                    "after checking its bytes instead", url)
        self.put(path, url, data)

    def _etag_if_holds(self, bucket: str, key: str, url: str, expected: bytes) -> str | None:
        """The ETag of the object if it holds exactly ``expected`` (one GET of at most one byte
        more, the ETag from the same response), else None."""
        from fsspec.asyn import sync

        async def get() -> tuple[str, bytes]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                          Range=f"bytes=0-{len(expected)}")
            body = resp["Body"]
            try:
                return resp["ETag"], await body.read()
            finally:
                body.close()
        if not expected:
            info = self._head(bucket, key, url)
            return info.get("ETag") if info is not None and info.get("ContentLength") == 0 else None
        try:
            etag, got = self.call("read", url, lambda: sync(self.fs.loop, get))
        except NotFoundError:
            return None
        return etag if got == expected else None

    def _head(self, bucket: str, key: str, url: str) -> dict[str, Any] | None:
        try:
            return self.call("stat", url, lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=key))
        except NotFoundError:
            return None

    def etag(self, path: str, url: str) -> str | None:
        """The object's ETag (one HEAD), None if there is none: what pins a server-side copy."""
        return self._etag(*self.bucket_key(path), url)

    def _etag(self, bucket: str, key: str, url: str) -> str | None:
        info = self._head(bucket, key, url)
        return None if info is None else info.get("ETag")

    def _holds(self, path: str, url: str, data: bytes) -> bool:
        try:
            return self.size(path, url) == len(data) and self.read(path, url) == data
        except StorageError:
            return False

    def open_uploads(self, root: str, path: str, url: str, exact: bool) -> list[OpenUpload]:
        """Multipart uploads started below ``path`` (``exact``: of the object ``path``) and never
        completed or aborted; keys relative to ``root``."""
        bucket, key = self.bucket_key(path)
        prefix = key if exact else (key.rstrip("/") + "/" if key else "")
        root_key = self.fs.split_path(root)[1].rstrip("/")
        out: list[OpenUpload] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        for _ in range(10_000):  # pages; bounded
            resp = self.call("list uploads", url, lambda: self.fs.call_s3("list_multipart_uploads", **kwargs))
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

    def abort_upload(self, path: str, url: str, upload_id: str) -> None:
        bucket, key = self.bucket_key(path)
        try:
            self.call("abort upload", url, lambda: self.fs.call_s3(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id))
        except NotFoundError:
            pass  # already gone


__all__ = ["OpenUpload", "S3Backend", "S3_CONFIG_DEFAULTS", "S3FS_RETRIES", "S3Upload"]
