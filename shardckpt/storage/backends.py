"""What differs between the places a :class:`~shardckpt.storage.core.Storage` can point to.

A backend is chosen once per location, when a :class:`~shardckpt.storage.core.Storage` is built,
from the table of :mod:`.backend` (which also states the interface): a local disk
(:class:`~shardckpt.storage.local.LocalBackend`), S3 (:class:`~shardckpt.storage.s3.S3Backend`),
process memory (:class:`~shardckpt.storage.memory.MemoryBackend`), or any other fsspec filesystem
(:class:`Backend`, this module, which the others extend). It parses its options, owns the
filesystem, the retry policy, the transfer sizes and its error vocabulary, and does every
operation on full paths; ``url`` arguments name the object in messages. Above the storage layer
nothing asks which backend it has: the storage offers the verbs (stage and install a write, map
a range or read it, create or replace conditionally) and the backend answers them.
"""

from __future__ import annotations

import functools
import logging
import posixpath
import time
from typing import Any, ClassVar, TypeVar
from collections.abc import Callable, Collection, Iterator, Mapping

from shardckpt.errors import CommitConflictError, StorageError
from shardckpt.storage.backend import known_elsewhere
from shardckpt.storage.options import BackendOptions, Tuning, own_settings, refuse_unknown
from shardckpt.storage.reads import read_ahead
from shardckpt.storage.retry import (
    NotFoundError, RetryPolicy, Verdict, classify, describe_error, map_error, retry_call,
)
from shardckpt.storage.writer import FsspecSink, Sink

log = logging.getLogger(__name__)
T = TypeVar("T")


def conflict_error(url: str) -> CommitConflictError:
    """What a create-only write raises when the object exists."""
    return CommitConflictError(f"{url} already exists: another save committed here first; "
                               "nothing was overwritten", url)


def changed_error(url: str) -> CommitConflictError:
    """What a conditional replace raises when the object is not the one expected."""
    return CommitConflictError(f"{url} no longer holds what this write was to replace (another "
                               "writer changed or removed it); nothing was replaced", url)


class Backend:
    """Any fsspec filesystem (``gs://``, ``az://``, ...): fsspec's own calls, each retried; the
    fallback of :data:`~shardckpt.storage.backend.BACKENDS` and the base of every backend there.

    Subclasses override what their kind does better or must do differently.
    """

    #: The URL schemes this class serves (the fallback serves what the table does not name).
    schemes: ClassVar[tuple[str, ...]] = ()
    #: Ranges of files here can be memory-mapped (:meth:`map_range`).
    can_map: ClassVar[bool] = False

    # ------------------------------------------------------------- options, opening, errors

    @classmethod
    def known_options(cls) -> Collection[str] | None:
        """The filesystem options this backend takes; None: any (fsspec judges them)."""
        return None

    @classmethod
    def parse_options(cls, raw: Mapping[str, Any]) -> BackendOptions:
        """shardckpt's own keys checked and popped, the rest checked against
        :meth:`known_options`: an option another backend of the table knows is left out (one
        set of options serves a command's source and destination: ``-o key=...`` for S3 does not
        reach a local destination); one no backend knows is a
        :class:`~shardckpt.errors.ConfigError` naming it."""
        fs, retry, tuning = own_settings(raw)
        known = cls.known_options() if fs else None
        if known is not None:
            foreign = [k for k in fs if k not in known]
            if foreign:
                elsewhere = known_elsewhere(cls)
                refuse_unknown({k: fs[k] for k in foreign if k not in elsewhere}, known,
                               f"{cls.schemes[0]}:// locations" if cls.schemes else cls.__name__)
                for k in foreign:
                    del fs[k]
        return BackendOptions(fs, retry, tuning)

    @classmethod
    def options_from_env(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        """``raw`` plus what the environment says for this kind of place: nothing here."""
        return dict(raw)

    @classmethod
    def fresh_listings(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        """``raw`` for a caller that polls listings: as it is here."""
        return dict(raw)

    @classmethod
    def open(cls, url: str, options: BackendOptions) -> tuple[Backend, str]:
        """The fsspec filesystem for ``url`` (created with ``options.fs``) and the root on it."""
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(url, **options.fs)
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"{url}: cannot open this location: {e}", url) from e
        except OSError as e:  # filesystems that connect or open an archive when created (ftp, zip)
            raise StorageError(f"{url}: cannot open this location: {describe_error(e)}", url) from e
        root = root.rstrip("/") if root not in ("/", "") else root
        return cls(fs, options.retry, options.tuning), root

    def __init__(self, fs: Any, retry: RetryPolicy, tuning: Tuning) -> None:
        self.fs, self.retry, self.tuning = fs, retry, tuning
        protocol = fs.protocol
        self.protocol: str = protocol if isinstance(protocol, str) else protocol[0]

    def classify(self, error: BaseException) -> Verdict:
        """``"retry"`` or ``"permanent"``, in the vocabulary fsspec filesystems share
        (:func:`~shardckpt.storage.retry.classify`)."""
        return classify(error)

    def call(self, what: str, url: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        """Run ``fn`` with retries on what :meth:`classify` calls transient until the deadline;
        map errors (see :func:`~shardckpt.storage.retry.retry_call`)."""
        return retry_call(self.retry, what, url, fn, deadline, classify=self.classify)

    # ------------------------------------------------------------------------------ reads

    def exists(self, path: str, url: str) -> bool:
        return self.call("exists", url, lambda: self.fs.exists(path))

    def isdir(self, path: str, url: str) -> bool:
        return self.call("isdir", url, lambda: self.fs.isdir(path))

    def size(self, path: str, url: str) -> int:
        info = self.call("stat", url, lambda: self.fs.info(path))
        if info.get("type") == "directory":
            raise StorageError(f"{url}: is a directory, expected a file", url)
        self._check_kind(info, url)
        return int(info["size"])

    def _check_kind(self, info: dict[str, Any], url: str) -> None:
        """Refuse what :meth:`size` must not report as a file (see the local backend)."""

    def ls(self, path: str, url: str) -> list[str]:
        try:
            entries = self.call("list", url, lambda: self.fs.ls(path, detail=False))
        except NotFoundError:
            return []
        base = path.rstrip("/")
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base})

    def list_sizes(self, path: str, url: str) -> dict[str, int]:
        def listing() -> list[Any]:
            self.fs.invalidate_cache(path)
            return self.fs.ls(path, detail=True)
        try:
            entries = self.call("list", url, listing)
        except NotFoundError:
            return {}
        base = path.rstrip("/")
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries
                if e.get("type") != "directory" and e["name"].rstrip("/") != base}

    def read(self, path: str, url: str, start: int | None = None, end: int | None = None) -> bytes:
        """Raw bytes ``[start, end)``. On an async object store a range larger than
        ``tuning.range_piece`` is fetched as concurrent ranged GETs; a failed piece is retried
        alone, all under one deadline."""
        piece = self.tuning.range_piece
        if (start is None or end is None or end - start <= piece
                or not getattr(self.fs, "async_impl", False)):
            return self.call("read", url, lambda: self.fs.cat_file(path, start=start, end=end))
        return self._read_pieces(path, url, start, end, piece)

    def _read_pieces(self, path: str, url: str, start: int, end: int, piece: int) -> bytes:
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
        for i, ((a, b), data) in enumerate(zip(bounds, out, strict=True)):
            if isinstance(data, BaseException):
                if self.classify(data) != "retry":
                    raise map_error(data, "read", url) from data
                log.info("read of %s [%d, %d) failed (%s); retrying", url, a, b,
                         describe_error(data))
                out[i] = self.call("read", url, functools.partial(self.fs.cat_file, path, start=a, end=b),
                                   deadline=deadline)
        return b"".join(out)

    def read_prefix(self, path: str, url: str, n: int) -> bytes:
        return self.call("read", url, lambda: self.fs.cat_file(path, start=0, end=n))

    def iter_chunks(self, path: str, url: str, chunk_size: int, limit: int | None) -> Iterator[bytes]:
        """Ranged reads of several chunks at a time (retried), the next read ahead while the
        caller checks the current one; memory is about two such reads."""
        total = self.size(path, url)
        if limit is not None:
            total = min(total, limit)
        step = max(chunk_size, self.tuning.range_piece // chunk_size * chunk_size)

        def fetch(a: int) -> bytes:
            return self.read(path, url, a, min(total, a + step))
        for a, data in read_ahead(range(0, total, step), fetch, "shardckpt-readahead"):
            if len(data) != min(total, a + step) - a:
                raise StorageError(f"{url}: bytes [{a}, {min(total, a + step)}) returned {len(data)} bytes")
            view = memoryview(data)
            for lo in range(0, len(view), chunk_size):
                yield bytes(view[lo:lo + chunk_size])

    def map_range(self, path: str, url: str, a: int, b: int, size: int) -> tuple[Any, int]:
        """(mapping, its offset in the file) of bytes ``[a, b)`` (only where :attr:`can_map`)."""
        raise NotImplementedError(f"{url}: {self.protocol} files cannot be mapped")

    # ----------------------------------------------------------------------------- writes

    def sink(self, path: str, url: str) -> Sink:
        """Where a streaming write goes: an fsspec file that commits on close."""
        return FsspecSink(self, path, url)

    def create_only(self, path: str, url: str, data: bytes) -> None:
        """Best effort here (check, then write); see the local and S3 backends."""
        if self.exists(path, url):
            raise conflict_error(url)
        self.call("write", url, lambda: self.fs.pipe_file(path, data))

    def replace_if(self, path: str, url: str, data: bytes, expected: bytes) -> None:
        """Check, then replace (:meth:`put`): where the store has no conditional write, the
        writer's lease keeps other saves of its own away and the caller reads back."""
        if not self.holds(path, url, expected):
            raise changed_error(url)
        self.put(path, url, data)

    def holds(self, path: str, url: str, data: bytes) -> bool:
        """Whether ``path`` holds exactly ``data`` (False if it is gone); reads at most one byte
        more than ``data``."""
        try:
            return self.read_prefix(path, url, len(data) + 1) == data
        except NotFoundError:
            return False

    def put(self, path: str, url: str, data: bytes) -> None:
        self.call("write", url, lambda: self.fs.pipe_file(path, data))

    def rename(self, path: str, to: str, url: str) -> bool:
        """Object stores (and fsspec's generic filesystems) have no atomic rename of a prefix."""
        return False

    def rm(self, path: str, url: str, recursive: bool = False) -> None:
        try:
            self.call("remove", url, lambda: self.fs.rm(path, recursive=recursive))
        except NotFoundError:
            pass

    def remove_inside(self, root: str, rel: str, root_url: str, recursive: bool) -> bool:
        """Remove ``rel`` below ``root`` and nothing outside it (see :mod:`.confined`). Object
        stores have no links: a plain removal of a checked relative path (True: whether it was
        there is not asked, to spare a request)."""
        from shardckpt.storage.confined import parts_of

        parts_of(rel, root_url)
        self.rm(posixpath.join(root, rel), f"{root_url}/{rel}", recursive)
        return True

    def first_link(self, root: str, rel: str, root_url: str) -> tuple[str, str] | None:
        """The first symbolic link at or on the way to ``rel``: object stores have none."""
        return None

    def staging_name(self, rel: str, token: str) -> str:
        """The name to write ``rel`` under until :meth:`install`: itself, where a write becomes
        visible only when complete."""
        return rel

    def install(self, staged: str, path: str, url: str) -> None:
        """Give the staged file ``staged`` (a full path) its name ``path``: nothing to do here."""

    def fsync_dir(self, path: str) -> None:
        """Make a directory's entries durable: object stores have no directories."""

    # --------------------------------------------------------------------------- places

    def location(self, path: str) -> tuple[str, str]:
        """(protocol, path with ``.``, ``..`` and repeated slashes folded)."""
        return self.protocol, posixpath.normpath("/" + path.lstrip("/"))

    def ensure_free_space(self, path: str, url: str, nbytes: int, what: str) -> None:
        """Object stores have no such limit to ask about."""

    def open_uploads(self, root: str, path: str, url: str, exact: bool) -> list[Any]:
        """Multipart uploads never completed or aborted: none outside object stores."""
        return []

    def abort_upload(self, path: str, url: str, upload_id: str) -> None:
        """Abort a multipart upload: none outside object stores."""

