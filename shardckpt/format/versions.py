"""Which version of the format a manifest is written as: the lowest that holds what it records.

Each minor version adds something a reader of an earlier one would misread or miss (docs/FORMAT.md
section 2): 1.1 the manifest's own checksum (every manifest written now), 1.2 chunked tensors,
1.3 ``frozen`` files, 1.4 a digest per file (and a signature), 1.5 BLAKE3 digests. A writer says what its manifest
holds (:class:`VersionedContent`, which :class:`~shardckpt.checkpoint.writer.CheckpointSpec` is)
and :func:`version_for` names the version; the writer never picks one itself. A data file's
safetensors header records the version that brought in its kind (:func:`file_version`). Pure.
"""

from __future__ import annotations

from typing import Protocol

from shardckpt.format.chunked import ROLE as CHUNKS_ROLE
from shardckpt.format.digests import ALGORITHMS
from shardckpt.format.manifest import CHUNKED_VERSION, FROZEN_ROLE, FROZEN_VERSION, VERSION

__all__ = ["VersionedContent", "file_version", "version_for"]


class VersionedContent(Protocol):
    """What a manifest holds that decides its version."""

    @property
    def chunked(self) -> object | None:
        """The chunked section (format 1.2), or None."""
        ...

    @property
    def frozen_files(self) -> bool:
        """Whether frozen groups lie in ``frozen`` files (format 1.3)."""
        ...

    @property
    def digest_algorithm(self) -> str | None:
        """The algorithm of every file's digest (``sha256``: format 1.4, ``blake3``: 1.5), or
        None without digests."""
        ...


def version_for(spec: VersionedContent) -> tuple[int, int]:
    """The lowest version of the format that holds what ``spec`` records."""
    version = FROZEN_VERSION if spec.frozen_files else VERSION if spec.chunked is None else CHUNKED_VERSION
    if spec.digest_algorithm is not None:
        version = max(version, ALGORITHMS[spec.digest_algorithm])
    return version


def file_version(role: str) -> str:
    """``"MAJOR.MINOR"`` the header of a data file of ``role`` records: the version that brought
    in ``chunks`` files (1.2) or ``frozen`` files (1.3); :data:`VERSION` for the others."""
    v = {CHUNKS_ROLE: CHUNKED_VERSION, FROZEN_ROLE: FROZEN_VERSION}.get(role, VERSION)
    return f"{v[0]}.{v[1]}"
