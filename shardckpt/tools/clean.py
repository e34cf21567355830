"""Find and remove the debris of saves that never committed. Offline; no torch.

Debris is: save directories (``<save-id>/``) that no manifest names, a checkpoint directory's
leftover temporary manifests, old shard files that a thinned manifest lists as removed
(``extras.thinned.removed``: a thinning killed while it removed them), and (object stores)
multipart uploads never completed. A committed
checkpoint is never touched. Saves may still be in progress: only debris older than ``min_age_s``
is removed (a save id begins with its UTC start time; uploads carry their start time), and a
save directory whose writer still holds its lease (:mod:`shardckpt.storage.lease`) is never removed,
whatever its age: a long save or reshard renews its lease until it commits or fails.

A checkpoint's live directories are those its manifest's files lie in (whatever its ``save_id``
says): their names are never debris, and clean does not look inside them. A save directory of a
sibling checkpoint that a committed manifest references (format 1.3 frozen files,
``../step-XXXXXXXX/<save-id>/...``) is live too, whatever its own manifest says (it may have been
replaced since): it is reported in :attr:`CleanReport.kept_referenced`, never removed.

Clean never leaves ``prefix``: a symbolic link found below it (a linked directory, a save
directory or a temporary manifest that is a link) is neither followed nor removed; it is reported
in :attr:`CleanReport.links`, and every removal goes through
:meth:`~shardckpt.storage.Storage.remove_inside`.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.references import parent_of
from shardckpt.checkpoint.run_dir import STEP_DIR
from shardckpt.checkpoint.thin import leftovers
from shardckpt.errors import LinkRefusedError, ShardckptError
from shardckpt.storage import live_until
from shardckpt.format.manifest import MANIFEST_NAME, reference_of
from shardckpt.storage import OpenUpload, Storage, abort_upload, list_open_uploads

SAVE_ID = re.compile(r"^([0-9]{8}T[0-9]{6}Z)-[0-9a-f]{8}\Z")
TMP_MANIFEST = re.compile(r"^manifest\.json\.tmp-[0-9a-f]+\Z")

log = logging.getLogger(__name__)


@dataclass
class CleanReport:
    debris: list[str] = field(default_factory=list)          # relative paths removed / to remove
    kept_young: list[str] = field(default_factory=list)      # debris younger than min_age
    kept_live: list[str] = field(default_factory=list)       # saves whose writer holds a lease
    uploads: list[OpenUpload] = field(default_factory=list)  # open multipart uploads found
    aborted: list[OpenUpload] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)       # checkpoints seen and left alone
    kept_referenced: list[str] = field(default_factory=list) # save dirs a committed manifest references
    links: list[tuple[str, str]] = field(default_factory=list)  # (relative path, target): not followed


def _age(save_id: str, now: float) -> float:
    m = SAVE_ID.fullmatch(save_id)
    if not m:
        return float("inf")
    started = _dt.datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=_dt.timezone.utc)
    return now - started.timestamp()


def live_dirs(save_id: str, files: Any) -> set[str]:
    """The names directly below a checkpoint directory that its manifest keeps alive: its save id
    and the first directory of every file it names (the manifest's ``save_id`` need not be where
    its files lie)."""
    return {save_id} | {f.path.split("/", 1)[0] for f in files if "/" in f.path}


def referenced_dirs(rel: str, files: Any) -> set[str]:
    """The save directories (relative to the prefix) that the manifest of checkpoint ``rel``
    references in sibling checkpoints: ``<parent of rel>/<step-dir>/<save-id>``."""
    out = set()
    up = rel.rsplit("/", 1)[0] if "/" in rel else ""
    for f in files:
        ref = reference_of(f.path) if f.path.startswith("../") else None
        if ref is not None and rel:
            out.add(f"{up}/{ref[0]}/{ref[1]}" if up else f"{ref[0]}/{ref[1]}")
    return out


def _scan(storage: Storage, rel: str, now: float, min_age_s: float, report: CleanReport, depth: int,
          referenced: set[str]) -> None:
    names = storage.ls(rel)
    join = (lambda n: f"{rel}/{n}") if rel else (lambda n: n)
    keep: set[str] = set()
    if MANIFEST_NAME in names:
        try:
            m = read_manifest(storage.child(rel) if rel else storage)
        except ShardckptError:
            return  # unreadable manifest: not ours to judge; leave its directory alone
        keep = live_dirs(m.save_id, m.files)
        # old shard files a thinning killed while removing them (the manifest lists them)
        report.debris += [join(p) for p in leftovers(storage.child(rel) if rel else storage, m)]
        referenced.update(referenced_dirs(rel, m.files))
        report.committed.append(rel or ".")
    for n in names:
        if n == MANIFEST_NAME or n in keep:
            continue
        link = storage.first_link(join(n))
        if link is not None:
            report.links.append((join(n), link[1]))
            continue
        if SAVE_ID.fullmatch(n):
            if live_until(storage, join(n), now) is not None:
                report.kept_live.append(join(n))
            else:
                (report.debris if _age(n, now) >= min_age_s else report.kept_young).append(join(n))
        elif TMP_MANIFEST.fullmatch(n):
            report.debris.append(join(n))
        elif depth > 0 and storage.isdir(join(n)):
            _scan(storage, join(n), now, min_age_s, report, depth - 1, referenced)


def clean(prefix: str, dry_run: bool = False, min_age_s: float = 3600.0,
          storage_options: Mapping[str, Any] | None = None, depth: int = 2) -> CleanReport:
    """Remove (or with ``dry_run`` only list) debris below ``prefix``; abort stale uploads."""
    storage = Storage(prefix, storage_options)
    now = time.time()
    report = CleanReport()
    referenced: set[str] = set()
    _scan(storage, "", now, min_age_s, report, depth, referenced)
    for name in ("debris", "kept_young", "kept_live"):
        found: list[str] = getattr(report, name)
        report.kept_referenced += [d for d in found if d in referenced]
        found[:] = [d for d in found if d not in referenced]
    report.uploads = list_open_uploads(storage)
    if dry_run:
        return report
    for rel in list(report.debris):
        try:
            storage.remove_inside(rel, recursive=True)
        except LinkRefusedError as e:  # replaced by a link since the scan: report it, go on
            log.warning("%s", e)
            report.debris.remove(rel)
            report.links.append((rel, e.target))
    for u in report.uploads:
        if now - u.initiated >= min_age_s:
            abort_upload(storage, u)
            report.aborted.append(u)
    return report


def remove_stale_saves(storage: Storage, keep: str, referenced: set[str] | None = None) -> list[str]:
    """Remove the save directories directly below ``storage`` other than ``keep`` whose writers
    hold no lease (killed or failed attempts, replaced checkpoints); return what was removed. A
    save directory that is a symbolic link is left alone (logged), never followed, and so is one
    that a committed sibling checkpoint references (``referenced``: their names, by default
    :func:`sibling_references`)."""
    now = time.time()
    removed = []
    if referenced is None:
        referenced = sibling_references(storage)
    for n in storage.ls(""):
        if n in referenced:
            log.info("%s: kept: a committed sibling checkpoint references its files",
                     storage.url_of(n))
            continue
        if SAVE_ID.fullmatch(n) and n != keep and live_until(storage, n, now) is None:
            try:
                storage.remove_inside(n, recursive=True)
            except LinkRefusedError as e:
                log.warning("%s", e)
                continue
            removed.append(n)
    return removed


def sibling_references(storage: Storage) -> set[str]:
    """The save directories of the checkpoint at ``storage`` that a committed sibling checkpoint
    (a step directory of the same run directory) references; empty where there is no parent."""
    run = parent_of(storage)
    name = storage.url.rstrip("/").rsplit("/", 1)[-1]
    if run is None:
        return set()
    out: set[str] = set()
    for sibling in run.ls(""):
        if sibling == name or not STEP_DIR.match(sibling) or not run.exists(f"{sibling}/{MANIFEST_NAME}"):
            continue
        try:
            m = read_manifest(run.child(sibling))
        except ShardckptError:
            continue
        for f in m.references():
            ref = reference_of(f.path)
            if ref is not None and ref[0] == name:
                out.add(ref[1])
    return out
