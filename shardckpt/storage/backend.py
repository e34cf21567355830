"""The storage backend interface, and the table that picks a backend class for a URL.

A backend serves one kind of place (a local disk, S3, process memory, any other fsspec
filesystem). It owns four things the rest of the storage layer asks it about and never decides
itself:

* its **options**: :meth:`StorageBackend.parse_options` turns a user's ``storage_options`` into
  filesystem options, the retry policy and transfer sizes, filling its own defaults and refusing
  options it does not know (naming them); :meth:`StorageBackend.open` opens a URL with them;
* its **errors**: :meth:`StorageBackend.classify` says whether an exception its filesystem raised
  is transient (``"retry"``: retried under the one deadline) or ``"permanent"``;
* its **conditional writes**: :meth:`StorageBackend.create_only` (the commit point: fails if the
  object exists) and :meth:`StorageBackend.replace_if` (replace only what the writer expected);
* the **primitives** everything else is built from: reads (whole, ranged, prefix, chunked,
  mapped), listings, streaming writes (a sink), staging and install, removal, places.

:data:`BACKENDS` maps a URL scheme to its class. A value is the class itself, or
``"module:Class"``, imported only when a URL of that scheme is opened (so that local work never
loads the S3 module). A scheme not in the table is served by the generic fsspec backend
(:data:`FALLBACK`). A new backend is one module with its class plus one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar
from collections.abc import Callable, Iterator, Mapping

from shardckpt.storage.options import BackendOptions, Tuning

if TYPE_CHECKING:
    from shardckpt.storage.retry import RetryPolicy, Verdict
    from shardckpt.storage.writer import Sink

T = TypeVar("T")


class StorageBackend(Protocol):
    """What a backend offers. Paths are full paths on its filesystem; each ``url`` names the
    object in messages (every error is a :class:`~shardckpt.errors.StorageError` naming it).
    :class:`~shardckpt.storage.backends.Backend` implements all of it over fsspec; a new backend
    usually subclasses it and overrides what its store does differently."""

    #: The URL schemes this class serves (each has its line in :data:`BACKENDS`).
    schemes: ClassVar[tuple[str, ...]]
    #: Ranges of files here can be memory-mapped (:meth:`map_range`).
    can_map: ClassVar[bool]
    protocol: str
    retry: RetryPolicy
    tuning: Tuning

    # ------------------------------------------------------------- options, opening, errors

    @classmethod
    def parse_options(cls, raw: Mapping[str, Any]) -> BackendOptions:
        """shardckpt's own keys (``shardckpt_*``) and this backend's filesystem options, with its
        defaults filled in; :class:`~shardckpt.errors.ConfigError` naming any option it does not
        know."""

    @classmethod
    def options_from_env(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        """``raw`` plus what the environment says for this kind of place (an S3 endpoint)."""

    @classmethod
    def fresh_listings(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        """``raw`` for a caller that polls listings: no cached listings where the store has any."""

    @classmethod
    def open(cls, url: str, options: BackendOptions) -> tuple[StorageBackend, str]:
        """A backend for ``url`` and the root path on its filesystem."""

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (the local backend creates it only when asked)."""

    def classify(self, error: BaseException) -> Verdict:
        """``"retry"`` for a transient failure of this store, ``"permanent"`` otherwise."""

    def call(self, what: str, url: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        """``fn`` retried on what :meth:`classify` calls transient, until the deadline; errors
        mapped to :class:`~shardckpt.errors.StorageError`."""

    # ------------------------------------------------------------------------------ reads

    def exists(self, path: str, url: str) -> bool: ...
    def isdir(self, path: str, url: str) -> bool: ...
    def size(self, path: str, url: str) -> int: ...
    def ls(self, path: str, url: str) -> list[str]: ...
    def list_sizes(self, path: str, url: str) -> dict[str, int]: ...
    def read(self, path: str, url: str, start: int | None = None, end: int | None = None) -> bytes: ...
    def read_prefix(self, path: str, url: str, n: int) -> bytes: ...
    def iter_chunks(self, path: str, url: str, chunk_size: int, limit: int | None) -> Iterator[bytes]: ...
    def map_range(self, path: str, url: str, a: int, b: int, size: int) -> tuple[Any, int]: ...

    # ----------------------------------------------------------------------------- writes

    def sink(self, path: str, url: str) -> Sink:
        """Where a streaming write goes; nothing is visible unless it closes."""

    def create_only(self, path: str, url: str, data: bytes) -> None:
        """Write ``data`` at ``path`` only if nothing is there, never visible half-written;
        :class:`~shardckpt.errors.CommitConflictError` if something is. A retry that meets the
        object its own lost-answer try created is success."""

    def replace_if(self, path: str, url: str, data: bytes, expected: bytes) -> None:
        """Replace ``path`` with ``data`` only if it holds exactly ``expected``, never visible
        half-written; :class:`~shardckpt.errors.CommitConflictError` (nothing replaced) if it
        holds anything else or is gone. Atomic where the store has a conditional write
        (S3 ``If-Match``), else check, then replace (the caller reads back)."""

    def put(self, path: str, url: str, data: bytes) -> None:
        """Replace ``path`` with ``data``, atomically where the store allows."""

    def rename(self, path: str, to: str, url: str) -> bool:
        """Rename ``path`` (a file or directory) to ``to`` atomically; False where the store
        cannot (nothing done)."""

    def rm(self, path: str, url: str, recursive: bool = False) -> None: ...
    def remove_inside(self, root: str, rel: str, root_url: str, recursive: bool) -> bool: ...
    def first_link(self, root: str, rel: str, root_url: str) -> tuple[str, str] | None: ...
    def staging_name(self, rel: str, token: str) -> str: ...
    def install(self, staged: str, path: str, url: str) -> None: ...
    def fsync_dir(self, path: str) -> None: ...

    # ----------------------------------------------------------------------------- places

    def location(self, path: str) -> tuple[str, str]: ...
    def ensure_free_space(self, path: str, url: str, nbytes: int, what: str) -> None: ...
    def open_uploads(self, root: str, path: str, url: str, exact: bool) -> list[Any]: ...
    def abort_upload(self, path: str, url: str, upload_id: str) -> None: ...


BackendRef = type | str

#: URL scheme -> backend class (or ``"module:Class"``, imported on first use).
BACKENDS: dict[str, BackendRef] = {
    "file": "shardckpt.storage.local:LocalBackend",
    "local": "shardckpt.storage.local:LocalBackend",
    "memory": "shardckpt.storage.memory:MemoryBackend",
    "s3": "shardckpt.storage.s3:S3Backend",
    "s3a": "shardckpt.storage.s3:S3Backend",
}
#: The backend of every other scheme: fsspec's own calls, each retried.
FALLBACK: BackendRef = "shardckpt.storage.backends:Backend"


def scheme_of(url: str) -> str:
    """The scheme that picks ``url``'s backend: ``file`` for a plain path, ``""`` for a chained
    URL (``a::b``, served by the fallback), else what precedes ``://``, in lower case."""
    if "::" in url:
        return ""
    head, sep, _ = url.partition("://")
    return head.lower() if sep else "file"


def resolve(ref: BackendRef) -> type[StorageBackend]:
    """The class a table entry names."""
    if isinstance(ref, str):
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)
    return ref


def backend_class(url: str) -> type[StorageBackend]:
    """The backend class that serves ``url`` (:data:`BACKENDS`, else :data:`FALLBACK`)."""
    return resolve(BACKENDS.get(scheme_of(url), FALLBACK))


def known_elsewhere(kind: type) -> set[str]:
    """The filesystem options the other classes of the table know (a class whose client is not
    installed, or that takes any option, adds nothing): one set of options often serves a
    command's source and destination, which may be different kinds of place."""
    out: set[str] = set()
    for other in {resolve(ref) for ref in BACKENDS.values()} - {kind}:
        try:
            known = other.known_options()  # type: ignore[attr-defined]
        except ImportError:
            continue
        if known is not None:
            out.update(known)
    return out


def parse_for(url: str, options: Mapping[str, Any] | None,
              ) -> tuple[type[StorageBackend], BackendOptions]:
    """The backend class for ``url`` and its parse of ``options`` (environment included)."""
    cls = backend_class(url)
    return cls, cls.parse_options(storage_options_from_env(url, options))


def split_options(url: str, options: Mapping[str, Any] | None,
                  ) -> tuple[dict[str, Any], RetryPolicy, Tuning, int | None]:
    """(fsspec options, retry policy, tuning, s3fs retries) from a user's ``storage_options``,
    as the backend for ``url`` parses them (:func:`parse_for`)."""
    parsed = parse_for(url, options)[1]
    return parsed.fs, parsed.retry, parsed.tuning, parsed.extra.get("s3fs_retries")


def storage_options_from_env(url: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """fsspec options for ``url``: the user's, plus what the environment says for its kind of
    place (for S3 an endpoint from ``AWS_ENDPOINT_URL(_S3)``; credentials such as
    ``AWS_ACCESS_KEY_ID`` are read by botocore itself)."""
    return backend_class(url).options_from_env(dict(options or {}))
