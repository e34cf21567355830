"""Reading untrusted input on a local disk without following a symbolic link out of its root.

Whoever wrote a checkpoint can plant symbolic links in it: a payload file that is a link to
``~/.aws/credentials`` would otherwise be read and copied into an import's output. The rule for a
reader of untrusted input: the root (named by the operator, so trusted, its own links resolved) is
resolved once, and a name below it is read only if, with every link on its way followed, it still
lies inside that resolved root. A link whose target stays inside works as before (a Hugging Face
cache's snapshot files are links into its ``blobs/`` folder: read with the cache folder as the
root, they resolve inside it); any other is refused with one error naming the link and its target.

The check is made on the path just before it is opened; a link swapped in between the check and
the read (by someone writing to the source while it is read) is outside what it guards against.
Object stores and other non-local filesystems have no links: nothing to check there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from shardckpt.errors import IntegrityError

if TYPE_CHECKING:
    from shardckpt.storage.core import Storage

__all__ = ["resolve_inside", "check_inside"]


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_inside(root: str, rel: str, url: str | None = None) -> str:
    """The real path of ``rel`` below the local directory ``root`` (every symbolic link
    resolved), refusing one that resolves outside ``root`` (itself resolved first): an
    :class:`IntegrityError` naming ``url`` (default: the path) and where it leads. A name that
    does not exist resolves to where it would be (the read that follows reports it missing)."""
    real_root = os.path.realpath(root)
    path = os.path.join(root, rel)
    real = os.path.realpath(path)
    if not _inside(real, real_root):
        raise IntegrityError(f"{url or path}: a symbolic link to {real}, outside "
                             f"{real_root}; links are followed only where they stay inside the "
                             "checkpoint's folder (copy the file in if it belongs there)")
    return real


def check_inside(storage: Storage, rel: str) -> None:
    """Refuse ``rel`` of ``storage`` if it is (or lies under) a symbolic link that leads out of
    the storage's root (:func:`resolve_inside`); a no-op where the storage is not a local disk."""
    from shardckpt.storage.local import LocalBackend

    if isinstance(storage.backend, LocalBackend):
        resolve_inside(storage.root, rel, storage.url_of(rel))
