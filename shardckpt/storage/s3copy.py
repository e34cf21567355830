"""Server-side copies of byte ranges between S3 objects (``UploadPartCopy``) inside the multipart
uploads of :mod:`.s3upload`, and the marker that offers them.

A tool that streams a source range unchanged into a new file (reshard: a slice of a source shard
that lands in one target slot) still *reads* it, checked against the source's chunk CRC32Cs as
every read is, and hands the writer the bytes wrapped by :func:`sourced`: bytes that also say
where they came from (the object, its ETag when read, the range). A plain sink writes them like
any bytes. An :class:`~shardckpt.storage.s3upload.S3Upload` on the same S3 service sends, for
such a range of at least :data:`MIN_COPY` bytes, an ``UploadPartCopy`` instead of the bytes:
the server copies them, pinned to the ETag (``x-amz-copy-source-if-match``), and the part is
kept only if its ETag, the MD5 the server computed of what it copied, is the MD5 of the bytes
in hand (moto ignores the precondition; this check does not depend on it). So the target holds
exactly what was read and checked, and its chunk CRC32Cs are computed from those bytes as for
any write. What is saved is the upload, not the read: "every byte read is checked" holds without
a re-read. (Skipping the read too would need the source's chunk CRC32Cs to carry over, which
they do only where source and target offsets agree modulo the chunk size and the range is whole
chunks: never for a flat reshard, whose target header and slot sizes differ from the source's.)

Where it cannot apply (then the bytes go up as a normal part, nothing else changes):

* ranges under :data:`MIN_COPY` (S3 parts are at least 5 MiB except the last): reshard of flat
  groups moves whole slots, so below about 5 MiB per slot (a 1 GB checkpoint over 16 ranks:
  2.2 MB) nothing is copied;
* a source on another service or with other credentials, or not on S3 (local to S3, S3 to local);
* bytes that change on the way (a dtype cast in consolidate; consolidate also writes new files
  whose tensors gather pieces from every source file);
* a server that refuses the copy (an error other than a deadline: ``NotImplemented``, access
  denied on the source, the source replaced since it was read: ``PreconditionFailed``), or whose
  copy's MD5 is not the bytes' (a replaced source; an ETag that is no MD5, as with SSE-KMS): the
  part falls back to uploading the bytes, logged once per upload, and no more copies are tried.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: The smallest range sent as a server-side copy: S3's minimum part size.
MIN_COPY = 5 << 20


@dataclass(frozen=True, slots=True)
class CopySource:
    """Where sourced bytes came from: ``service`` (what makes two filesystems the same S3
    service with the same rights: :func:`service_of`), the object, its ETag when it was read,
    and the byte range ``[start, end)``."""

    service: tuple[str, ...]
    bucket: str
    key: str
    etag: str
    start: int
    end: int


def service_of(fs: Any) -> tuple[str, ...]:
    """What two s3fs filesystems must share for a copy between them: endpoint and credentials."""
    kw = getattr(fs, "client_kwargs", None) or {}
    return (str(kw.get("endpoint_url")), str(getattr(fs, "key", None)),
            str(getattr(fs, "secret", None)), str(getattr(fs, "token", None)))


def sourced(data: Any, source: CopySource | None) -> Any:
    """``data`` (read from ``source``) marked as copyable by a sink on the same service; as it is
    where ``source`` is None or the range is too small to copy. No copy of the bytes."""
    if source is None or source.end - source.start < MIN_COPY:
        return data
    import numpy as np

    arr: Any = np.frombuffer(data, np.uint8).view(_sourced_class())
    arr.copy_source = source
    return arr


def source_of(view: memoryview) -> CopySource | None:
    """The source of bytes :func:`sourced` marked (``view`` over all of them), else None."""
    obj: Any = view.obj
    src: CopySource | None = getattr(obj, "copy_source", None)
    if src is None or view.nbytes != src.end - src.start or view.nbytes != obj.nbytes:
        return None
    return src


@functools.cache
def _sourced_class() -> type:
    """A numpy array subclass (numpy is imported on first use only): the bytes stay where they
    are, and ``memoryview(...).obj`` leads a sink back to the marker."""
    import numpy as np

    class Sourced(np.ndarray):
        """Bytes with a ``copy_source`` attribute (set by :func:`sourced`)."""

        copy_source: CopySource | None = None

    return Sourced


def copy_part(host: Any, bucket: str, key: str, upload_id: str, number: int,
              src: CopySource, url: str) -> dict[str, Any]:
    """``UploadPartCopy`` of ``src``'s range as part ``number``; the part's entry for the
    completion. Retried like any part, under the deadline."""
    out = host.call(f"copy of part {number}", url, lambda: host.fs.call_s3(
        "upload_part_copy", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
        CopySource={"Bucket": src.bucket, "Key": src.key},
        CopySourceRange=f"bytes={src.start}-{src.end - 1}", CopySourceIfMatch=src.etag))
    return {"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"]}


def copy_source_for(storage: Any, rel: str, start: int, end: int,
                    etags: dict[str, str | None]) -> CopySource | None:
    """Where bytes ``[start, end)`` of ``rel`` (on ``storage``) can be copied from server-side:
    None below :data:`MIN_COPY` or off S3. The object's ETag comes from one HEAD per object
    (cached in ``etags``); a copy pinned to it fails, and falls back to an upload, if the object
    was replaced since (checkpoint files never are)."""
    backend = storage.backend
    etag_of = getattr(backend, "etag", None)
    if end - start < MIN_COPY or etag_of is None:
        return None
    path = storage.full(rel)
    if path not in etags:
        etags[path] = etag_of(path, storage.url_of(rel))
    etag = etags[path]
    if etag is None:
        return None
    bucket, key = backend.bucket_key(path)
    return CopySource(service_of(backend.fs), bucket, key, etag, start, end)
