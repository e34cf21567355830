"""The :class:`Storage` handle: a root URL and the backend chosen for it (:mod:`.backend`'s
table), with paths relative to the root. Every operation is the backend's (:mod:`.backends`,
:mod:`.local`, :mod:`.memory`, :mod:`.s3`)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar
from collections.abc import Callable, Iterator, Mapping

from shardckpt.errors import StorageError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage.backend import StorageBackend, parse_for
from shardckpt.storage.checked import read_checked
from shardckpt.storage.options import Tuning
from shardckpt.storage.retry import RetryPolicy
from shardckpt.storage.prealloc import preallocated
from shardckpt.storage.writer import StreamWriter

T = TypeVar("T")


def open_backend(url: str, storage_options: Mapping[str, Any] | None,
                 retry: RetryPolicy | None) -> tuple[StorageBackend, str]:
    """The backend for ``url`` (the class :data:`~shardckpt.storage.backend.BACKENDS` names for
    its scheme, parsing its own options) and the root path on its filesystem. A local path
    without options is served without importing fsspec."""
    kind, options = parse_for(url, storage_options)
    if retry is not None:
        options = dataclasses.replace(options, retry=retry)
    return kind.open(url, options)


class Storage:
    """A root URL and its backend. Methods take paths relative to the root.

    ``backend`` (a backend and the root path on it) builds a handle on a place an existing
    backend serves, as :meth:`child` does; otherwise the backend is chosen for ``url``.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 retry: RetryPolicy | None = None,
                 backend: tuple[StorageBackend, str] | None = None) -> None:
        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        self.backend, self.root = backend or open_backend(url, storage_options, retry)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    @property
    def fs(self) -> Any:
        """The fsspec filesystem."""
        return self.backend.fs

    @property
    def retry(self) -> RetryPolicy:
        return self.backend.retry

    @property
    def tuning(self) -> Tuning:
        return self.backend.tuning

    # ---------------------------------------------------------------------------- paths

    def full(self, rel: str) -> str:
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root not in ("", "/") else f"{self.root}{rel}"

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> Storage:
        """A Storage rooted at ``rel`` below this one (the same backend and options)."""
        return Storage(self.url_of(rel), self.storage_options, backend=(self.backend, self.full(rel)))

    def call(self, what: str, rel: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        """Run ``fn`` with retries on transient errors until the deadline; map errors.

        ``deadline`` (``time.monotonic()`` seconds) lets several calls share one; by default it
        is the policy's ``deadline_s`` from now. Backoff is capped, exponential and jittered.
        """
        return self.backend.call(what, self.url_of(rel), fn, deadline)

    def write_opener(self, rel: str, spare: Any = None) -> Callable[[], int] | None:
        """Where the backend is a local file system: a function that opens ``rel`` for writing
        (created or truncated, its directories made, as the backend's own writes are: a private
        directory's ``0600``, no link followed) and returns the descriptor, for a parallel
        positioned write. ``spare``: a :class:`~shardckpt.storage.spare.Spare` on the same file
        system, taken over (renamed to ``rel``, not truncated: the writer cuts it to size) where
        one is ready when the function is called. None elsewhere."""
        opener = getattr(self.backend, "open_for_write", None)
        if opener is None:
            return None
        path, url = self.full(rel), self.url_of(rel)

        def open_fd() -> int:
            taken = spare.claim() if spare is not None else None
            return int(self.backend.call("open", url, lambda: opener(path, url, taken)))
        return open_fd

    def preallocate(self, rel: str, nbytes: int) -> None:
        """Local: make ``rel`` a file of ``nbytes`` allocated bytes (``posix_fallocate``), as the
        backend creates files; :class:`StorageError` elsewhere, or where there is no room (the
        file then removed, as every removal here: :meth:`remove_inside`)."""
        opener = getattr(self.backend, "open_for_write", None)
        url = self.url_of(rel)
        if opener is None:
            raise StorageError(f"{url}: preallocation needs a local file system")
        try:
            self.backend.call("preallocate", url, lambda: preallocated(opener, self.full(rel), url, nbytes))
        except StorageError:
            self.remove_inside(rel)
            raise

    def location(self, rel: str = "") -> tuple[str, str]:
        """(protocol, normalized path), equal for two handles on the same place: local paths
        resolved (symlinks, ``..``, ``.``), object-store paths with ``.``, ``..`` and repeated
        slashes folded. :func:`.places.contains` compares two of them."""
        return self.backend.location(self.full(rel))

    def ensure_free_space(self, rel: str, nbytes: int, what: str) -> None:
        """Local: refuse, before anything is written, a write of ``nbytes`` below ``rel`` that its
        file system has no room for (:class:`InsufficientSpaceError`, naming both figures and the
        path). Object stores: no-op."""
        self.backend.ensure_free_space(self.full(rel), self.url_of(rel), nbytes, what)

    # ------------------------------------------------------------------------------ reads

    def exists(self, rel: str) -> bool:
        return self.backend.exists(self.full(rel), self.url_of(rel))

    def isdir(self, rel: str = "") -> bool:
        return self.backend.isdir(self.full(rel), self.url_of(rel))

    def size(self, rel: str) -> int:
        """Size of file ``rel`` (a local one must be a regular file)."""
        return self.backend.size(self.full(rel), self.url_of(rel))

    def ls(self, rel: str = "") -> list[str]:
        """Names (not paths) directly below ``rel``; empty if it does not exist."""
        return self.backend.ls(self.full(rel), self.url_of(rel))

    def list_sizes(self, rel: str = "") -> dict[str, int]:
        """Name -> size of the files directly below ``rel``, fresh from one listing (on S3 one
        LIST of the prefix, not a HEAD per object); empty if ``rel`` does not exist."""
        return self.backend.list_sizes(self.full(rel), self.url_of(rel))

    def read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """Raw bytes ``[start, end)`` of ``rel`` (no checksum; see :meth:`read_checked`).

        On an async object store a range larger than ``tuning.range_piece`` is fetched as
        concurrent ranged GETs; a failed piece is retried alone, all under one deadline.
        """
        return self.backend.read(self.full(rel), self.url_of(rel), start, end)

    def read_prefix(self, rel: str, n: int) -> bytes:
        """At most the first ``n`` bytes of ``rel``: one bounded read under one retry deadline,
        whatever the file claims its size is (a local file must be a regular file)."""
        return self.backend.read_prefix(self.full(rel), self.url_of(rel), n)

    def read_limited(self, rel: str, limit: int) -> bytes:
        """The whole of a small file, refusing one larger than ``limit`` (reads at most
        ``limit + 1`` bytes, in one operation)."""
        data = self.read_prefix(rel, limit + 1)
        if len(data) > limit:
            raise StorageError(f"{self.url_of(rel)}: at least {len(data)} bytes, more than the "
                               f"{limit} allowed", self.url_of(rel))
        return data

    def read_checked(self, entry: FileEntry, chunk_size: int, start: int, end: int,
                     prefix: str = "") -> memoryview:
        """Bytes ``[start, end)`` of ``entry``, reading whole chunks and checking each CRC32C
        (:func:`.checked.read_checked`; many ranges: :class:`.reads.RangeReader`)."""
        return read_checked(self, entry, chunk_size, start, end, prefix)

    # ----------------------------------------------------------------------------- writes

    def writer(self, rel: str, chunk_size: int, digest: str | None = None) -> StreamWriter:
        """A checksumming streaming write of ``rel``: visible only once closed, never partial
        (``digest``: with the digest of :mod:`shardckpt.format.digests` of that algorithm too)."""
        path, url = self.full(rel), self.url_of(rel)
        return StreamWriter(lambda: self.backend.sink(path, url), url, chunk_size, digest)

    def staging_name(self, rel: str, token: str) -> str:
        """The name to write ``rel`` under until :meth:`install` gives it its own: on a local disk
        ``<rel>.partial-<token>``; where writes become visible only when complete (object
        stores), ``rel`` itself."""
        return self.backend.staging_name(rel, token)

    def install(self, staged: str, rel: str) -> None:
        """Rename the complete file ``staged`` (:meth:`staging_name`) to ``rel`` (no-op where it
        was written under its own name)."""
        if staged != rel:
            self.backend.install(self.full(staged), self.full(rel), self.url_of(staged))

    def create_only(self, rel: str, data: bytes) -> None:
        """Write ``data`` at ``rel`` only if nothing is there: the commit point of a checkpoint.

        Local: write a temporary file, fsync, then ``link`` it into place (fails if the target
        exists), so the target is never seen half-written. S3: one PUT with ``If-None-Match: *``.
        Other filesystems: check, then write. Raises :class:`CommitConflictError` if the object
        exists.
        """
        self.backend.create_only(self.full(rel), self.url_of(rel), data)

    def replace_if(self, rel: str, data: bytes, expected: bytes) -> None:
        """Replace ``rel`` with ``data`` only if it holds exactly ``expected``; else
        :class:`CommitConflictError` and nothing is replaced.

        S3: one PUT with ``If-Match: <etag>`` of the object found holding ``expected``. Local:
        check, then a complete temporary file renamed into place (the writer's lease keeps
        other saves of its own away). Other filesystems: check, then write.
        """
        self.backend.replace_if(self.full(rel), self.url_of(rel), data, expected)

    def put(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically where the filesystem allows (local: rename)."""
        self.backend.put(self.full(rel), self.url_of(rel), data)

    def rename(self, rel: str, to: str) -> bool:
        """Give ``rel`` (a file or a whole directory) the new name ``to`` (which must not exist;
        its parent is created) in one atomic step where the store has one (a local disk: one
        ``rename``, then both parents synced); False, with nothing done, where it has none
        (object stores)."""
        return self.backend.rename(self.full(rel), self.full(to), self.url_of(rel))

    def rm(self, rel: str, recursive: bool = False) -> None:
        self.backend.rm(self.full(rel), self.url_of(rel), recursive)

    def remove_inside(self, rel: str, recursive: bool = False) -> bool:
        """Remove ``rel`` (with ``recursive``, a whole directory) and nothing outside this
        storage's root: the removal every destructive command uses (clean, retention,
        ``--overwrite``). Local: the root is resolved once; no symbolic link below it is followed
        or removed: a link at or on the way to ``rel`` raises
        :class:`~shardckpt.errors.LinkRefusedError` (naming it and its target) and nothing is
        removed; links inside a directory being removed are unlinked, never followed. Object
        stores: a plain removal. Local: True if ``rel`` was there."""
        return self.backend.remove_inside(self.root, rel, self.url, recursive)

    def first_link(self, rel: str) -> tuple[str, str] | None:
        """(url, target) of the first symbolic link at or on the way to ``rel``, or None (always
        on object stores): what :meth:`remove_inside` would refuse."""
        return self.backend.first_link(self.root, rel, self.url)

    def fsync_dir(self, rel: str = "") -> None:
        """Local: make the entries of directory ``rel`` durable (a file created in it survives a
        power loss only once its directory is synced). Object stores have no directories: no-op."""
        self.backend.fsync_dir(self.full(rel))


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    return Storage(url, storage_options)


def iter_file_chunks(storage: Storage, rel: str, chunk_size: int, limit: int | None = None) -> Iterator[bytes]:
    """Sequential reads of ``rel`` in ``chunk_size`` pieces (bounded memory), up to ``limit`` bytes.

    Remote: ranged reads of several chunks at a time (retried), the next read ahead while the
    caller checks the current one; memory is about two such reads.
    """
    return storage.backend.iter_chunks(storage.full(rel), storage.url_of(rel), chunk_size, limit)


def list_open_uploads(storage: Storage, rel: str = "", exact: bool = False) -> list[Any]:
    """Multipart uploads (:class:`~shardckpt.storage.s3.OpenUpload`) started below ``rel``
    (``exact``: of the object ``rel``) and never completed or aborted (object stores only)."""
    return storage.backend.open_uploads(storage.root, storage.full(rel), storage.url_of(rel), exact)


def abort_upload(storage: Storage, upload: Any) -> None:
    """Abort an upload :func:`list_open_uploads` found (gone already is fine)."""
    storage.backend.abort_upload(storage.full(upload.key), storage.url_of(upload.key), upload.upload_id)
