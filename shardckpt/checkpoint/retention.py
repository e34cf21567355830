"""Retention per component: which committed checkpoints of a run stay whole, which keep their
weights only (thinned, :mod:`shardckpt.checkpoint.thin`), and which go.

``RetentionPolicy(keep_last=3, keep_optimizer_last=1, keep_every=1000)`` keeps, newest first:

* the newest ``keep_optimizer_last`` checkpoints whole (weights and optimizer state): what a
  resumed job needs;
* the newest ``keep_last`` ones, and every one whose step is a multiple of ``keep_every``, with
  their weights: past the optimizer window they are thinned into weights-only checkpoints;
* nothing else.

Whatever the policy, the newest committed checkpoint and the one ``latest`` names stay whole, and
a checkpoint whose frozen files a kept one references stays (thinned where it is past the optimizer
window: thinning never touches frozen files). ``keep_optimizer_last=None`` keeps every kept
checkpoint whole (the behaviour before retention per component); ``keep_last=None`` keeps all.
:func:`plan_retention` is pure; :func:`apply_retention` carries a plan out on one run directory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Sequence

from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.thin import Resign, optimizer_kinds, thin
from shardckpt.errors import CommitConflictError, ConfigError, LinkRefusedError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.storage import Storage

log = logging.getLogger(__name__)


class Run(Protocol):
    """What retention needs of a run directory
    (:class:`~shardckpt.checkpoint.run_dir.CheckpointManager` is one)."""

    storage: Storage
    thin_settled: set[str]

    def committed(self) -> Sequence[Any]: ...          # .step, .name; oldest first
    def read_latest(self) -> str | None: ...
    def referenced(self, kept: list[str]) -> set[str]: ...


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_optimizer_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_optimizer_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1 (or None); got {v!r}")
        if (self.keep_last is not None and self.keep_optimizer_last is not None
                and self.keep_optimizer_last > self.keep_last):
            raise ConfigError(f"keep_optimizer_last ({self.keep_optimizer_last}) is more than "
                              f"keep_last ({self.keep_last}): a checkpoint keeps its optimizer "
                              "state only while it is kept")

    @property
    def active(self) -> bool:
        return self.keep_last is not None or self.keep_optimizer_last is not None


@dataclass(frozen=True)
class RetentionPlan:
    """Names of committed checkpoints (oldest first in each list)."""

    whole: tuple[str, ...] = ()
    thin: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    referenced: tuple[str, ...] = ()  # kept (in whole or thin) only because a kept one references them


def plan_retention(policy: RetentionPolicy, committed: Sequence[tuple[int, str]],
                   protect: set[str] = frozenset()) -> RetentionPlan:  # type: ignore[assignment]
    """Split ``committed`` ((step, name), oldest first) as ``policy`` says (module doc); the
    newest and every name in ``protect`` stay whole."""
    whole, thinned, removed = [], [], []
    n = len(committed)
    for i, (step, name) in enumerate(committed):
        age = n - 1 - i  # 0: the newest
        opt = policy.keep_optimizer_last
        in_weights = (policy.keep_last is None or age < policy.keep_last
                      or (policy.keep_every is not None and step % policy.keep_every == 0))
        if age == 0 or name in protect or (in_weights and (opt is None or age < opt)):
            whole.append(name)
        elif in_weights:
            thinned.append(name)
        else:
            removed.append(name)
    return RetentionPlan(tuple(whole), tuple(thinned), tuple(removed))


@dataclass
class RetentionReport:
    removed: list[str] = field(default_factory=list)          # URLs
    thinned: list[str] = field(default_factory=list)          # URLs
    kept_referenced: list[str] = field(default_factory=list)  # URLs
    skipped: list[str] = field(default_factory=list)          # "URL: why" (not thinned)


def retention_plan(manager: Run, policy: RetentionPolicy) -> RetentionPlan:
    """The plan for ``manager``'s run now, with references respected: a checkpoint to remove
    that a kept one references is kept (thinned where its optimizer window has passed)."""
    committed = manager.committed()
    protect = {manager.read_latest() or ""}
    plan = plan_retention(policy, [(f.step, f.name) for f in committed], protect)
    doomed = set(plan.remove)
    needed = manager.referenced([f.name for f in committed if f.name not in doomed])
    kept = [n for n in plan.remove if n in needed]
    if not kept:
        return plan
    order = {f.name: i for i, f in enumerate(committed)}
    whole, thinned = list(plan.whole), list(plan.thin)
    (whole if policy.keep_optimizer_last is None else thinned).extend(kept)
    return RetentionPlan(tuple(sorted(whole, key=order.__getitem__)),
                         tuple(sorted(thinned, key=order.__getitem__)), tuple(n for n in plan.remove if n not in needed),
                         tuple(kept))


def apply_retention(manager: Run, policy: RetentionPolicy,
                    resign: Resign | None = None, dry_run: bool = False) -> RetentionReport:
    """Carry out :func:`retention_plan` on ``manager``'s run: thin first (each by its own
    conditional manifest replace), then remove (the manifest first, so that a half-removed
    checkpoint never looks committed). With ``dry_run`` only report what would be done."""
    report = RetentionReport()
    if not policy.active:
        return report
    plan = retention_plan(manager, policy)
    storage = manager.storage
    for name in plan.referenced:
        log.info("retention keeps %s: a kept checkpoint references its frozen files", storage.url_of(name))
        report.kept_referenced.append(storage.url_of(name))
    # a checkpoint once thinned (or found weights only, or left whole with a warning) by this
    # manager is not read again at each save
    settled = manager.thin_settled
    for name in plan.thin:
        if name in settled:
            continue
        link = storage.first_link(name)
        if link is not None:  # never written through, as never removed through
            log.warning("retention leaves %s whole: it is or lies behind a symbolic link to %s",
                        storage.url_of(name), link[1])
            continue
        if dry_run:
            if _holds_optimizer(storage.child(name)):
                report.thinned.append(storage.url_of(name))
            continue
        if _thin_one(storage.child(name), resign, report):
            settled.add(name)
    for name in plan.remove:
        url = storage.url_of(name)
        if not dry_run:
            try:
                storage.remove_inside(f"{name}/{MANIFEST_NAME}")
                storage.remove_inside(name, recursive=True)
            except LinkRefusedError as e:
                log.warning("retention: %s", e)
                continue
            log.info("retention removed %s", url)
        report.removed.append(url)
    return report


def _holds_optimizer(child: Storage) -> bool:
    try:
        return bool(optimizer_kinds(read_manifest(child)))
    except ShardckptError:
        return False


def _thin_one(child: Any, resign: Resign | None, report: RetentionReport) -> bool:
    """Thin one checkpoint; whether it is settled (thinned, weights only already, or one that
    thinning leaves whole): False where a later pass should try again."""
    try:
        done = thin(child, resign)
    except ShardckptError as e:  # a conflict, or damage: kept whole; the next pass tries again
        verb = "did not" if isinstance(e, CommitConflictError) else "could not"
        log.warning("retention %s thin %s: %s", verb, child.url, e)
        report.skipped.append(f"{child.url}: {e}")
        return False
    if done is not None:
        report.thinned.append(child.url)
    return True

