"""Storage over fsspec: the only package that touches files or object stores.

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
  split into pieces fetched concurrently, and each failed piece is retried alone. A stream's batch
  (reshard, consolidate) has all its reads in flight at once, up to :data:`REMOTE_READS_IN_FLIGHT`,
  whichever files they are of; consolidate's are kept in flight across batches
  (:func:`windowed_reads`). A chunk whose CRC32C fails is read once more before the read is
  declared corrupt (a bad transfer is not a bad object). Nothing is staged on local disk.
* **Writes** stream as multipart uploads that shardckpt drives itself (not ``fs.open("wb")``,
  whose ``__exit__`` on an exception completes the partial object): parts of ``part_size`` bytes
  go up concurrently, at most ``concurrency`` in flight, and each part is retried as a unit (it is
  still in memory) under the deadline. A file whose producer or any part fails is aborted: the
  multipart upload is aborted and nothing becomes visible. Memory per writer is at most
  ``(concurrency + 1) x part_size``. Files smaller than a part are one PUT. A source range of at
  least :data:`MIN_COPY` bytes that reshard moves unchanged between objects of one service is
  copied by the server (``UploadPartCopy``) after it has been read and checked, and kept only if
  the server's MD5 of the copy is that of the checked bytes (:mod:`.s3copy`).
* **Commit** is a PUT with ``If-None-Match: *``. moto answers a conflict with FileExistsError,
  Ceph with 412 PreconditionFailed (OSError(EINVAL)); both become
  :class:`~shardckpt.errors.CommitConflictError`. If a retried commit meets a conflict, the object
  is read back: our own bytes (a first try that landed but whose answer was lost) are success.
  ``--overwrite`` replaces a manifest with a PUT carrying ``If-Match: <etag>`` of the object a GET
  found holding the expected bytes (Ceph RGW matches the ETag only without its quotes; that
  spelling is tried when the quoted one is refused while the object is unchanged).

Modules: :mod:`.core` (the :class:`Storage` handle), :mod:`.backend` (the backend interface and
the table that picks a backend class by URL scheme: :data:`BACKENDS`), :mod:`.backends` (the
generic fsspec backend every other one extends), :mod:`.local` (the local disk) and
:mod:`.local_windows` (its reads straight into memory, on several threads), :mod:`.memory`
(``memory://``), :mod:`.s3` (S3: options, error codes, the conditional writes) and
:mod:`.s3upload` (its multipart uploads, open uploads), :mod:`.s3copy` (server-side copies of
checked ranges), :mod:`.writer` (streaming, checksummed
writes), :mod:`.checked` and :mod:`.reads` (the checked read path: one range, many ranges,
read-ahead), :mod:`.read_window` (a stream's reads kept in flight across batches), :mod:`.retry` (deadline, the shared error vocabulary, error mapping),
:mod:`.options` (``storage_options``), :mod:`.places` (comparable locations, free space),
:mod:`.confined` (local removals that never follow a symbolic link out of the directory they were
asked for).
Import from this package; the split is not part of the API (``tests/test_layers.py`` holds every
module outside it to that). :mod:`.commit`, the commit protocol, is exported whole, as a namespace
(``commit.replace``, ``commit.current_manifest``). :mod:`.s3` is loaded when an ``s3://``
location is opened or one of its names is asked for here, so that local work never loads it.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardckpt.storage.core import (
    Storage, abort_upload, iter_file_chunks, list_open_uploads, open_storage,
)
from shardckpt.storage.backend import (
    BACKENDS, StorageBackend, backend_class, split_options, storage_options_from_env,
)
from shardckpt.storage.options import (
    DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, BackendOptions, MiB, Tuning,
)
from shardckpt.storage.reads import (
    DEFAULT_BATCH, DEFAULT_BUFFER, REMOTE_READS_IN_FLIGHT, RangeReader, pool_map, read_ahead,
)
from shardckpt.storage.s3copy import MIN_COPY, CopySource, copy_source_for, sourced
from shardckpt.storage.retry import (
    DEADLINE_ENV, DeadlineExceededError, NotFoundError, RetryPolicy, mapped_errors,
)
from shardckpt.storage.digest import ChunkHasher, hash_chunks
from shardckpt.storage.writer import StreamWriter, crc32c, crc32c_combine
from shardckpt.storage.checked import ChunkCheck, read_checked, spans
from shardckpt.storage.links import check_inside, resolve_inside
from shardckpt.storage.places import contains
from shardckpt.storage.reads import Request
from shardckpt.storage.read_window import windowed_reads
from shardckpt.storage.local import LocalBackend, local_path, open_regular, read_local_into
from shardckpt.storage.local_windows import read_windows
from shardckpt.storage.private_dir import private_storage
from shardckpt.storage.pipeline import (
    FileReads, IOConfig, Reader, Ring, Slot, check_chunks, local_reader, pipelined_reads, windows,
)
from shardckpt.storage.pwrite import Staged, write_positioned
from shardckpt.storage.spare import Spare
# After core and retry: these two import Storage and NotFoundError from this package.
from shardckpt.storage.lease import DEFAULT_TTL_S, LEASE_PREFIX, Lease, live_until, whoami
from shardckpt.storage import commit

_S3_NAMES = frozenset({"OpenUpload", "S3_CONFIG_DEFAULTS", "S3FS_RETRIES", "S3Upload"})


def __getattr__(name: str) -> Any:
    if name in _S3_NAMES:
        return getattr(importlib.import_module("shardckpt.storage.s3"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS", "BackendOptions", "ChunkCheck", "ChunkHasher", "CopySource", "DEADLINE_ENV",
    "DEFAULT_BATCH", "DEFAULT_BUFFER", "DEFAULT_CONCURRENCY", "DEFAULT_PART_SIZE", "DEFAULT_TTL_S",
    "DeadlineExceededError", "FileReads", "IOConfig", "LEASE_PREFIX", "Lease", "LocalBackend",
    "MIN_COPY", "MiB", "NotFoundError", "OpenUpload", "REMOTE_READS_IN_FLIGHT", "RangeReader",
    "Reader", "Request", "RetryPolicy", "Ring", "S3FS_RETRIES", "S3Upload", "S3_CONFIG_DEFAULTS",
    "Slot", "Spare", "Staged", "Storage", "StorageBackend", "StreamWriter", "Tuning", "abort_upload",
    "backend_class", "check_chunks", "check_inside", "commit", "contains", "copy_source_for", "crc32c",
    "crc32c_combine", "hash_chunks", "iter_file_chunks", "list_open_uploads", "live_until",
    "local_path", "local_reader", "mapped_errors", "open_regular", "open_storage",
    "pipelined_reads", "pool_map", "private_storage", "read_ahead", "read_checked", "read_local_into",
    "read_windows", "resolve_inside", "sourced", "spans", "split_options",
    "storage_options_from_env", "whoami",
    "windowed_reads", "windows", "write_positioned",
]
