"""Where a storage points: comparing locations, and the free space of a local destination. Pure
helpers over paths; each backend (:mod:`.backends`) says which apply to it."""

from __future__ import annotations

import os

from shardckpt.errors import InsufficientSpaceError


def contains(outer: tuple[str, str], inner: tuple[str, str]) -> bool:
    """Whether location ``inner`` is ``outer`` or lies below it (locations as
    :meth:`~shardckpt.storage.core.Storage.location` gives them)."""
    if outer[0] != inner[0]:
        return False
    return inner[1] == outer[1] or inner[1].startswith(outer[1].rstrip("/") + "/")


def ensure_free_space(path: str, url: str, nbytes: int, what: str) -> None:
    """Raise :class:`InsufficientSpaceError` if the local file system of ``path`` (its nearest
    existing directory) has fewer than ``nbytes`` bytes free for an unprivileged writer."""
    if nbytes <= 0:
        return
    probe = os.path.abspath(path or "/")
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except (OSError, AttributeError):  # no statvfs (not POSIX) or not reachable: do not guess
        return
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise InsufficientSpaceError(
            f"{what}: {url} needs {nbytes} bytes ({_human(nbytes)}), but the file system of {probe} "
            f"has {free} bytes ({_human(free)}) free; nothing was written", url)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
