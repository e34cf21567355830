"""The exception hierarchy of shardckpt.

Every error a user can meet derives from :class:`ShardckptError`. Messages say what was found, what
was expected and, where there is one, what to do next; they name the file or object involved.
"""

from __future__ import annotations


class ShardckptError(Exception):
    """Base class of every error shardckpt raises on purpose."""


class ManifestError(ShardckptError):
    """A manifest is missing, malformed, hostile, of a newer major version, or self-inconsistent."""


class IncompatibleLayoutError(ShardckptError):
    """Two layouts cannot be mapped onto each other (missing, unexpected or reshaped parameters)."""

    def __init__(
        self,
        message: str,
        missing: tuple[str, ...] = (),
        unexpected: tuple[str, ...] = (),
        mismatched: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched


class IncompleteCheckpointError(ShardckptError):
    """A checkpoint never committed, or its files do not match what its manifest says."""


class IntegrityError(IncompleteCheckpointError):
    """Bytes read back do not match their recorded checksum or size."""


class ReplicaMismatchError(ShardckptError):
    """HSDP replicas of a shard hold different bytes at a save (silent data corruption on one of
    the ranks named); the save is not committed (:mod:`shardckpt.checkpoint.replica_check`)."""


class TrustError(ShardckptError):
    """A checkpoint read with ``trust`` is unsigned, signed by a key not trusted, or its bytes do
    not match what its signed manifest records (docs/FORMAT.md section 16)."""


class StorageError(ShardckptError):
    """An I/O operation failed; the original OSError (or client error) is kept as ``__cause__``."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class NotFoundError(StorageError):
    """The object does not exist."""


class DeadlineExceededError(StorageError):
    """A transient failure persisted until the retry deadline."""


class LinkRefusedError(StorageError):
    """A destructive operation (clean, retention, ``--overwrite``) met a symbolic link at or on
    the way to what it was to remove. It follows no link and removes none: ``link`` names the
    link, ``target`` where it points; nothing was removed."""

    def __init__(self, message: str, path: str | None = None, link: str = "", target: str = "") -> None:
        super().__init__(message, path)
        self.link = link
        self.target = target


class CommitConflictError(StorageError):
    """A create-only write found the object already there: another save committed first."""


class InsufficientSpaceError(StorageError):
    """The destination's file system has less free space than a write needs; nothing was written."""


class UnsafePickleError(ShardckptError):
    """A pickled value (a DCP ``torch.save`` blob) is not one ``torch.load(weights_only=True)``
    loads: it names a global outside torch's allow-list (``refused``, e.g. ``posix.system``) or
    uses what that unpickler refuses. Nothing of it was run; ``key`` and ``file`` name it."""

    def __init__(self, message: str, key: str = "", file: str = "",
                 refused: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.key = key
        self.file = file
        self.refused = tuple(refused)


class CollectiveError(ShardckptError):
    """One or more ranks failed inside a collective operation; ``failures`` maps rank to message."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        # set by collective.agree: each failed rank's exception class names (and bases), in
        # method-resolution order, and its message
        self.kinds: dict[int, set[str]] = {}
        self.kind_order: dict[int, list[str]] = {}
        self.messages: dict[int, str] = {}


class ConfigError(ShardckptError, ValueError):
    """An option or combination of options is invalid."""
