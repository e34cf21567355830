"""Where a :class:`~shardckpt.storage.core.Storage` points: a comparable location, containment, and
the free space of a local destination."""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING

from shardckpt.errors import InsufficientSpaceError

if TYPE_CHECKING:
    from shardckpt.storage.core import Storage


def location(storage: Storage, rel: str = "") -> tuple[str, str]:
    """(protocol, normalized path), equal for two spellings of one place.

    Local paths are resolved (symlinks, ``..``, ``.``); object-store paths are bucket and key with
    ``.``, ``..`` and repeated slashes folded. :func:`contains` compares two of them.
    """
    if storage.is_local:
        return "file", os.path.realpath(storage.full(rel) or "/")
    fs_protocol = storage.fs.protocol
    protocol = "s3" if storage.is_s3 else fs_protocol if isinstance(fs_protocol, str) else fs_protocol[0]
    return protocol, posixpath.normpath("/" + storage.full(rel).lstrip("/"))


def contains(outer: tuple[str, str], inner: tuple[str, str]) -> bool:
    """Whether location ``inner`` is ``outer`` or lies below it."""
    if outer[0] != inner[0]:
        return False
    return inner[1] == outer[1] or inner[1].startswith(outer[1].rstrip("/") + "/")


def ensure_free_space(storage: Storage, rel: str, nbytes: int, what: str) -> None:
    """Local: raise :class:`InsufficientSpaceError` if the file system of ``rel`` (its nearest
    existing directory) has fewer than ``nbytes`` bytes free for an unprivileged writer. Object
    stores have no such limit to ask about: no-op."""
    if not storage.is_local or nbytes <= 0:
        return
    probe = os.path.abspath(storage.full(rel) or "/")
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except (OSError, AttributeError):  # no statvfs (not POSIX) or not reachable: do not guess
        return
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        url = storage.url_of(rel)
        raise InsufficientSpaceError(
            f"{what}: {url} needs {nbytes} bytes ({_human(nbytes)}), but the file system of {probe} "
            f"has {free} bytes ({_human(free)}) free; nothing was written", url)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
