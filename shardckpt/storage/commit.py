"""The steps of a commit that protect it: every named file is there, directories are durable, and
a replaced manifest is replaced only if it is still the one the writer meant to replace.

Used by :class:`~shardckpt.checkpoint.writer.CheckpointWriter`; no I/O of its own beyond
:mod:`shardckpt.storage`.
"""

from __future__ import annotations

import json
import posixpath

from shardckpt.errors import CommitConflictError, IncompleteCheckpointError
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from shardckpt.storage import NotFoundError, Storage


def check_files(storage: Storage, m: Manifest) -> None:
    """Every file ``m`` names exists with its recorded size: one listing per directory (on S3 one
    LIST of the save-id prefix). Raises :class:`IncompleteCheckpointError` naming the others."""
    by_dir: dict[str, list] = {}
    for f in m.files:
        by_dir.setdefault(posixpath.dirname(f.path), []).append(f)
    bad: list[str] = []
    for d, entries in by_dir.items():
        sizes = storage.list_sizes(d)
        for f in entries:
            name = posixpath.basename(f.path)
            if name not in sizes:
                bad.append(f"{f.path} (missing)")
            elif sizes[name] != f.size:
                bad.append(f"{f.path} ({sizes[name]} bytes, written as {f.size})")
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise IncompleteCheckpointError(
            f"{storage.url}: not committed: {len(bad)} file(s) of save {m.save_id} are not as "
            f"written: {', '.join(bad[:5])}{more} (removed by another process, e.g. `shardckpt "
            "clean`?)")


def sync_dirs(storage: Storage, save_id: str) -> None:
    """Local: fsync the save directory and the directories above it that a save may have created
    (the checkpoint directory and its parent), so the files survive a power loss with the
    manifest that names them."""
    for rel in (save_id, "", ".."):
        storage.fsync_dir(rel)


def current_manifest(storage: Storage) -> bytes | None:
    """The raw bytes of ``manifest.json`` now, or None if there is none."""
    try:
        return storage.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except NotFoundError:
        return None


def save_id_of(data: bytes | None) -> str:
    """The save id a manifest's bytes record, as words for a message."""
    if data is None:
        return "none (the manifest was removed)"
    try:
        sid = json.loads(data).get("save_id")
    except (ValueError, AttributeError):
        sid = None
    return f"save {sid}" if isinstance(sid, str) else "an unreadable manifest"


def replace(storage: Storage, data: bytes, expected: bytes, save_id: str) -> None:
    """Replace ``manifest.json`` with ``data`` if it still holds ``expected``
    (:meth:`Storage.replace_if`: on S3 a PUT with ``If-Match``), then read it back.

    Before: if another save replaced or removed the manifest meanwhile, nothing is replaced (its
    checkpoint stays). After: if a concurrent writer replaced it in between, this save lost:
    :class:`CommitConflictError` says which save holds the checkpoint.
    """
    url = storage.url_of(MANIFEST_NAME)
    try:
        storage.replace_if(MANIFEST_NAME, data, expected)
    except CommitConflictError as e:
        now = current_manifest(storage)
        raise CommitConflictError(
            f"{url} changed while save {save_id} was written (it now holds {save_id_of(now)}); "
            "nothing was replaced", url) from e
    after = current_manifest(storage)
    if after != data:
        raise CommitConflictError(
            f"{url}: save {save_id} was replaced by {save_id_of(after)}, which committed at the "
            "same time; the checkpoint there is that save's", url)
