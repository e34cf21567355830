"""Checkpoints that a resume passed over, put aside as evidence so that the run can save their
step numbers again; and a node's own copy of a file that fails its checksums, moved aside so
that its copy on another node is used.

A resume that falls back past a newer committed checkpoint (a checksum failure, files lost with
their peer copies, two saves under one step) leaves that checkpoint's ``manifest.json`` behind;
left there, the run's next save of the same step would meet it and fail, at every restart. So
once the ranks have loaded the checkpoint they resume from, every committed step directory newer
than it is put aside (:func:`put_aside`), never deleted:

* where the store renames atomically (a local disk: the local tier's node directories, a run
  directory on a file system), the whole step directory is renamed to
  ``<dir>/passed-over/<step-dir>.<save-id>`` with a note, ``passed-over.json``, that says why
  (the step then is no longer committed, in one step, and nothing of it is lost);
* elsewhere (object stores, which have no rename), its manifest is copied (create-only) to
  ``<run>/passed-over/<step-dir>.<save-id>/manifest.json`` beside the note, and stays where it
  is until the run saves that step again: the save's commit then finds it recorded there and
  replaces it by a conditional write (:func:`supersede`; on S3 a PUT with ``If-Match``), so a
  manifest that changed meanwhile (another save) is never replaced. Its files stay below the
  step directory until retention or ``shardckpt clean`` removes them.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from typing import NoReturn
from collections.abc import Mapping

from shardckpt.checkpoint.references import RunFiles, parent_of
from shardckpt.errors import CommitConflictError, IntegrityError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, Manifest
from shardckpt.storage import NotFoundError, Storage, crc32c
from shardckpt.storage import commit as _commit

log = logging.getLogger(__name__)

#: The folder, beside the step directories, that holds what resumes passed over.
PASSED_OVER = "passed-over"
#: The note in each passed-over directory: why it was passed over, and when.
NOTE = "passed-over.json"


class DamagedCopyError(IntegrityError):
    """A node's own copy of a file failed its checksums during a load and was moved aside (see
    :func:`move_damaged`): the same step can be loaded again with a copy from another node."""


def _token(data: bytes | None) -> str:
    """A name for what a step directory held: its manifest's save id where it has one, else the
    CRC32C of the manifest's bytes, else ``no-manifest``."""
    if data is None:
        return "no-manifest"
    try:
        sid = json.loads(data).get("save_id")
    except (ValueError, AttributeError, UnicodeDecodeError):
        sid = None
    if isinstance(sid, str) and sid.replace("-", "").isalnum() and len(sid) <= 64:
        return sid
    return f"crc-{crc32c(data):08x}"


def _note(name: str, why: str, data: bytes | None) -> bytes:
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({"step_dir": name, "why": why, "put_aside": now,
                       "manifest": _commit.save_id_of(data)}, indent=1).encode()


def put_aside(storage: Storage, name: str, why: str) -> str | None:
    """Put step directory ``name`` of ``storage`` (a run directory or a node's directory) aside
    as the module docstring says, with ``why`` in its note; the URL of where it went (None:
    nothing is there, or nothing committed on a store without rename). Raises
    :class:`~shardckpt.errors.ShardckptError` where that fails."""
    try:
        data = _commit.current_manifest(storage.child(name))
    except ShardckptError:
        data = b""  # unreadable: a token of its own, the directory is moved all the same
    base = f"{PASSED_OVER}/{name}.{_token(data)}"
    dest = base
    for i in range(1, 1000):
        if not storage.exists(dest):
            break
        dest = f"{base}.{i}"
    if storage.exists(name) and storage.rename(name, dest):
        storage.put(f"{dest}/{NOTE}", _note(name, why, data))
        return storage.url_of(dest)
    if not data:
        return None
    dest = base
    try:
        storage.create_only(f"{dest}/{MANIFEST_NAME}", data)
    except CommitConflictError:
        if _commit.current_manifest(storage.child(dest)) != data:
            raise
    storage.put(f"{dest}/{NOTE}", _note(name, why, data))
    return storage.url_of(dest)


def put_aside_all(storage: Storage, names: Mapping[str, str], where: str) -> list[str]:
    """:func:`put_aside` each step directory of ``names`` (name -> why), with one warning each
    saying where it went and why; a failure is a warning too (the resume has succeeded; the
    save of that step will say what is in its way). The URLs put aside."""
    out = []
    for name, why in sorted(names.items()):
        try:
            url = put_aside(storage, name, why)
        except ShardckptError as e:
            log.warning("%s: could not put %s aside (%s); it was passed over because %s, and a "
                        "save of that step will meet it", where, storage.url_of(name), e, why)
            continue
        if url is not None:
            log.warning("%s: %s was passed over at resume (%s); put aside as %s, so that the "
                        "step can be saved again", where, storage.url_of(name), why, url)
            out.append(url)
    return out


def supersede(storage: Storage, data: bytes, save_id: str) -> bool:
    """The commit of ``data`` into checkpoint directory ``storage`` met a manifest there: if a
    resume put that manifest aside (its bytes recorded in the run's ``passed-over`` folder),
    replace it with ``data`` by a conditional write and return True; else False (nothing done)."""
    run = parent_of(storage)
    if run is None:
        return False
    name = storage.url.rstrip("/").rpartition("/")[2]
    current = _commit.current_manifest(storage)
    if current is None:
        return False
    record = f"{PASSED_OVER}/{name}.{_token(current)}/{MANIFEST_NAME}"
    if _commit.current_manifest(run.child(record.rpartition("/")[0])) != current:
        return False
    _commit.replace(storage, data, current, save_id)
    log.warning("%s: the manifest there was passed over at resume (recorded in %s); replaced by "
                "save %s", storage.url, run.url_of(record), save_id)
    return True


def raise_damaged(damaged: list[tuple[Storage, str, str]]) -> NoReturn:
    """Rename each node's own copy ``(storage, rel, problem)`` that failed its checksums to
    ``<rel>.damaged-<n>`` beside it (the node then no longer holds it, and its copy on another
    node can take its place), with a warning naming it; then raise :class:`DamagedCopyError`
    (plain :class:`IntegrityError` where none could be moved) naming them."""
    said, moved_any = [], False
    for storage, rel, problem in damaged:
        n = 1
        try:
            while storage.exists(f"{rel}.damaged-{n}"):
                n += 1
            moved = storage.rename(rel, f"{rel}.damaged-{n}")
        except NotFoundError:  # another rank of the node moved it first
            moved = True
        except ShardckptError as e:
            log.warning("%s fails its checksums (%s) and could not be moved aside: %s",
                        storage.url_of(rel), problem, e)
            moved = False
        if moved:
            log.warning("%s fails its checksums (%s); moved aside to %s, so that its copy on "
                        "another node is used", storage.url_of(rel), problem,
                        f"{rel.rpartition('/')[2]}.damaged-{n}")
        moved_any = moved_any or moved
        said.append(f"{problem}" + (" (moved aside)" if moved else ""))
    cls = DamagedCopyError if moved_any else IntegrityError
    raise cls(f"{len(damaged)} file(s) of this node fail their checksums: " + "; ".join(said[:3]))


def raise_damaged_role(files: RunFiles, m: Manifest, role: str, index: int | None,
                       error: IntegrityError) -> NoReturn:
    """:func:`raise_damaged` of the file of ``role`` (and ``index``) that ``m`` names, which a
    local read found damaged (``error``)."""
    entry = next(f for f in m.files if f.role == role and (index is None or f.index == index))
    storage, rel = files.locate(entry.path)
    raise_damaged([(storage, rel, str(error))])
