"""Checkpoint directories of one run: ``<run>/step-00000100/``, the ``latest`` pointer, retention.

Rules (what a resumed job relies on):

* a step directory counts only once its ``manifest.json`` exists (the save committed);
* ``latest`` names a committed directory and is written only after that commit (also when a
  rank was lost after the manifest was created: the save committed, and rank 0 says so);
* retention keeps the newest ``keep_last`` committed checkpoints (and every ``keep_every``-th
  step), the newest ``keep_optimizer_last`` of them whole and the others thinned into weights
  only (:mod:`shardckpt.checkpoint.retention`); it never deletes nor thins the newest one, nor
  deletes one whose frozen files a kept checkpoint references (format 1.3; it says so in the log);
* resume picks the newest committed checkpoint that passes a check (manifest parses, every file
  present with its recorded size; optionally every checksum), skipping directories without a
  manifest and checkpoints that fail, whatever ``latest`` says; a job that needs optimizer state
  also passes over a checkpoint retention thinned into weights only (:meth:`CheckpointManager.lacks`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Mapping

from shardckpt.checkpoint.reader import as_storage, read_manifest
from shardckpt.checkpoint.references import RunFiles, referenced_steps, referenced_steps_in
from shardckpt.checkpoint.retention import RetentionPolicy, apply_retention
from shardckpt.checkpoint.thin import Resign, optimizer_kinds, thinned_record
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import IncompleteCheckpointError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from shardckpt.storage import NotFoundError, Storage

log = logging.getLogger(__name__)

LATEST = "latest"
STEP_DIR = re.compile(r"^step-([0-9]{8,})\Z")


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class Found:
    step: int
    name: str
    url: str


class CheckpointManager:
    """The step directories below ``run_url`` (a URL, or a :class:`Storage` already open on it).
    Safe to call from one process (rank 0). A subclass for another naming of the step
    directories sets :attr:`DIR_PATTERN` (one group: the step) and :meth:`dir_name`."""

    DIR_PATTERN = STEP_DIR

    def dir_name(self, step: int) -> str:
        return step_dir(step)

    def __init__(self, run_url: str | Storage, keep_last: int | None = None,
                 storage_options: Mapping[str, Any] | None = None, *,
                 keep_optimizer_last: int | None = None, keep_every: int | None = None,
                 resign: Resign | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ShardckptError(f"keep_last must be >= 1 (or None to keep all); got {keep_last}")
        self.storage = as_storage(run_url, storage_options)
        self.keep_last = keep_last
        self.policy = RetentionPolicy(keep_last, keep_optimizer_last, keep_every)
        #: signs a thinned manifest of a signed checkpoint (else such a checkpoint stays whole)
        self.resign = resign
        #: URLs the last :meth:`apply_retention` kept because a kept checkpoint references them
        self.kept_referenced: list[str] = []
        #: URLs the last :meth:`apply_retention` thinned into weights-only checkpoints
        self.thinned: list[str] = []
        #: names retention has thinned or found settled (not read again at each save)
        self.thin_settled: set[str] = set()

    @property
    def url(self) -> str:
        return self.storage.url

    def url_for(self, step: int) -> str:
        return self.storage.url_of(self.dir_name(step))

    def step_dirs(self) -> list[tuple[int, str]]:
        """(step, name) of every step directory, committed or not, oldest first."""
        out = []
        for name in self.storage.ls(""):
            m = self.DIR_PATTERN.match(name)
            if m:
                out.append((int(m.group(1)), name))
        return sorted(out)

    def committed(self) -> list[Found]:
        """Step directories with a manifest, oldest first."""
        return [Found(s, n, self.storage.url_of(n)) for s, n in self.step_dirs()
                if self.storage.exists(f"{n}/{MANIFEST_NAME}")]

    def read_latest(self) -> str | None:
        """The directory name ``latest`` points at, or None."""
        try:
            name = self.storage.read_limited(LATEST, 4096).decode().strip()
        except (NotFoundError, UnicodeDecodeError):
            return None
        return name if self.DIR_PATTERN.match(name) else None

    def check(self, found: Found, full: bool = False) -> list[str]:
        """Problems of one committed checkpoint: manifest and sizes, or every checksum if ``full``."""
        child = self.storage.child(found.name)
        if full:
            return list(verify(child).problems)
        try:
            m = read_manifest(child)
        except ShardckptError as e:
            return [str(e)]
        problems = []
        files = RunFiles(child)  # a referenced file of an earlier checkpoint is checked too
        for f in m.files:
            try:
                size = files.size(f.path)
            except NotFoundError:
                problems.append(f"{files.url_of(f.path)}: missing{files.missing_note(f)}")
                continue
            except ShardckptError as e:
                problems.append(str(e))
                continue
            if size != f.size:
                problems.append(f"{files.url_of(f.path)}: {size} bytes, the manifest records {f.size}")
        return problems

    def is_committed(self, step: int) -> bool:
        return self.storage.exists(f"{self.dir_name(step)}/{MANIFEST_NAME}")

    def resume_points(self, full_verify: bool = False) -> Iterator[Found]:
        """Committed checkpoints that pass :meth:`check`, newest first (checked as iterated)."""
        for found in reversed(self.committed()):
            problems = self.check(found, full_verify)
            if not problems:
                yield found
            else:
                log.warning("skipping %s: %s", found.url, problems[0])

    def resume_point(self, full_verify: bool = False) -> Found | None:
        """The newest committed checkpoint that passes :meth:`check`; None if there is none."""
        return next(self.resume_points(full_verify), None)

    def latest_url(self) -> str | None:
        """The URL of the committed checkpoint ``latest`` names (the run's previous save, which a
        new one may reference), or None."""
        name = self.read_latest()
        if name is None or not self.storage.exists(f"{name}/{MANIFEST_NAME}"):
            return None
        return self.storage.url_of(name)

    def references_of(self, name: str) -> set[str]:
        """The step directories whose files the checkpoint in ``name`` references. A manifest
        that does not parse is scanned for references instead, so that what it may need is
        kept all the same."""
        child = self.storage.child(name)
        try:
            return referenced_steps(read_manifest(child))
        except ShardckptError:
            try:
                return referenced_steps_in(child.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES))
            except ShardckptError:
                return set()

    def referenced(self, kept: list[str]) -> set[str]:
        """The step directories that the checkpoints in ``kept``, and those they need in turn,
        reference (closed over: a kept checkpoint's references are kept too)."""
        out: set[str] = set()
        todo = list(kept)
        seen = set(todo)
        while todo:
            for ref in self.references_of(todo.pop()):
                out.add(ref)
                if ref not in seen:
                    seen.add(ref)
                    todo.append(ref)
        return out

    def mark_committed(self, step: int) -> None:
        """Point ``latest`` at ``step`` (which must be committed), then apply retention."""
        name = self.dir_name(step)
        if not self.storage.exists(f"{name}/{MANIFEST_NAME}"):
            raise IncompleteCheckpointError(f"{self.storage.url_of(name)} has no {MANIFEST_NAME}; "
                                            "latest is not moved to an uncommitted save")
        self.storage.put(LATEST, (name + "\n").encode())
        self.apply_retention()

    def apply_retention(self) -> list[str]:
        """Apply :attr:`policy` (:mod:`shardckpt.checkpoint.retention`): thin the checkpoints past
        their optimizer window, delete those beyond it; return the URLs deleted.

        A checkpoint whose files a kept one references (format 1.3 frozen files) is kept, and
        logged; its URL is in :attr:`kept_referenced` afterwards, the thinned ones in
        :attr:`thinned`."""
        report = apply_retention(self, self.policy, self.resign)
        self.kept_referenced, self.thinned = report.kept_referenced, report.thinned
        return report.removed

    def lacks(self, found: Found, optimizer: bool) -> list[str]:
        """Why ``found`` does not hold what a job needs (empty if it does): with ``optimizer``,
        a checkpoint thinned by retention into weights only."""
        if not optimizer:
            return []
        try:
            m = read_manifest(self.storage.child(found.name))
        except ShardckptError as e:
            return [str(e)]
        rec = thinned_record(m)
        if rec is None or optimizer_kinds(m):
            return []
        return [f"it holds weights only (retention thinned it at {rec.get('at')}, removing "
                f"{', '.join(map(str, rec.get('dropped') or ())) or 'the optimizer state'}) and "
                "this job needs optimizer state (it has an optimizer and loads everything)"]


@dataclass(frozen=True)
class Resolved:
    """The checkpoint a location names: its ``url``, the :class:`Storage` open on it (what the
    work that follows reads through, so that the location is opened once), and ``note``, for the
    user, where the checkpoint is not the location itself (None where it is)."""

    url: str
    storage: Storage
    note: str | None = None
    run: Storage | None = None  # the run directory's storage, where ``url`` was resolved from one


def resolve_checkpoint(url: str, storage_options: Mapping[str, Any] | None = None) -> Resolved:
    """The checkpoint ``url`` names, with its storage open, and a note for the user when that is
    not ``url`` itself.

    A ``url`` with its own ``manifest.json``, or one that is no run directory, comes back as it is
    (its reader reports whatever is wrong with it). A run directory (``latest`` or
    ``step-XXXXXXXX`` directories, no manifest of its own) resolves to the committed checkpoint
    that ``latest`` names, with the note ``"run directory: using latest -> step-00000100"``;
    without a usable ``latest``, :class:`IncompleteCheckpointError` says that ``url`` is a run
    directory and lists the committed checkpoints it holds.
    """
    manager = CheckpointManager(url, storage_options=storage_options)
    storage = manager.storage
    if storage.exists(MANIFEST_NAME):
        return Resolved(url, storage)
    has_latest = storage.exists(LATEST)
    steps = manager.step_dirs()
    if not has_latest and not steps:
        return Resolved(url, storage)
    committed = manager.committed()
    latest = manager.read_latest()
    if latest is not None and any(f.name == latest for f in committed):
        return Resolved(storage.url_of(latest), storage.child(latest),
                        f"run directory: using latest -> {latest}", storage)
    if not committed:
        raise IncompleteCheckpointError(
            f"{storage.url} is a run directory with no committed checkpoint: none of its "
            f"{len(steps)} step directories has a {MANIFEST_NAME} (the saves never committed)")
    if latest is not None:
        why = f"its latest names {latest}, which has no {MANIFEST_NAME}"
    else:
        why = "it has no usable latest pointer" if has_latest else "it has no latest pointer"
    names = [f.name for f in committed]
    listed = ", ".join(names) if len(names) <= 6 else \
        f"{', '.join(names[:2])}, ..., {', '.join(names[-3:])} ({len(names)} in all)"
    raise IncompleteCheckpointError(
        f"{storage.url} is a run directory, not a checkpoint, and {why}; its committed "
        f"checkpoints: {listed}. Name one, e.g. {storage.url_of(names[-1])}")
