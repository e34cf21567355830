"""The ``retain`` step: prune a run's old checkpoints and what the pipeline derived from them.

Which checkpoints go: committed ones older than the newest ``keep`` (counted up to the checkpoint
being processed; with ``keep_every``, a step that is its multiple stays) whose every earlier step
is settled, never the newest committed one, the one ``latest`` names, nor one whose frozen files a
checkpoint that stays references. With ``keep_optimizer_last``, the kept ones older than the newest
that many are thinned into weights-only checkpoints (:mod:`shardckpt.checkpoint.retention`). The run's own
naming decides what a checkpoint is (:func:`shardckpt.checkpoint.run_names.run_manager`).

With each checkpoint, its *derived outputs* go: the ``dst`` of every step before this ``retain``
(reshard, consolidate, copy), filled in for that checkpoint. Each is removed the way it commits,
backwards: a shardckpt checkpoint's ``manifest.json`` first, a consolidation's index first (then
its provenance), so that a half-removed output never looks committed and the watcher never
adopts it. A derived checkpoint that a kept sibling in its own directory references (frozen
files, format 1.3) is kept and reported, as in the run itself.

Nothing outside the run directory and the outputs' directories is touched; a directory that is
a symbolic link (or lies behind one) is left alone and reported in ``links``, never followed.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any
from collections.abc import Callable, Mapping

from shardckpt.checkpoint.run_dir import CheckpointManager, Found
from shardckpt.checkpoint.retention import RetentionPolicy, plan_retention
from shardckpt.checkpoint.run_names import run_manager
from shardckpt.checkpoint.thin import thin
from shardckpt.errors import LinkRefusedError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.storage import Storage
from shardckpt.watch.config import StepSpec

log = logging.getLogger(__name__)

#: What commits a consolidation (written last), removed first; then its provenance.
CONSOLIDATED_FIRST = ("model.safetensors.index.json", "shardckpt_consolidated.json")


def retain(run: Storage, step: int, keep: int, steps: tuple[StepSpec, ...],
           storage_options: Mapping[str, Any], is_settled: Callable[[str], bool],
           keep_optimizer_last: int | None = None, keep_every: int | None = None) -> dict[str, Any]:
    """Prune ``run`` when its checkpoint of ``step`` is processed (see the module doc); the
    ``.done`` facts: ``removed`` (checkpoint names), ``derived`` (output URLs), ``links``,
    ``referenced``, ``thinned`` (checkpoint names thinned into weights only)."""
    manager = run_manager(run)
    every = manager.committed()
    committed = [f for f in every if f.step <= step]
    protect = {f.name for f in every[-1:]} | {manager.read_latest() or ""}
    plan = plan_retention(RetentionPolicy(keep, keep_optimizer_last, keep_every),
                          [(f.step, f.name) for f in committed], protect)
    doomed = [f for f in committed if f.name in plan.remove and is_settled(f.name)]
    gone = {f.name for f in doomed}
    needed = manager.referenced([f.name for f in every if f.name not in gone])
    referenced = [f.name for f in doomed if f.name in needed]
    for name in referenced:
        log.info("retain keeps %s: a kept checkpoint references its frozen files",
                 manager.storage.url_of(name))
    thinned = _thin(manager, [f.name for f in committed if is_settled(f.name) and (
        f.name in plan.thin or (keep_optimizer_last is not None and f.name in referenced))])
    removed: list[str] = []
    derived: list[str] = []
    links: list[dict[str, str]] = []
    for f in doomed:
        if f.name in needed:
            continue
        if not _remove(manager.storage, f.name, MANIFEST_NAME, links):
            continue
        log.info("retain removed %s", f.url)
        removed.append(f.name)
        derived += _remove_derived(f, steps, storage_options, links, referenced)
    return {"removed": removed, "bytes": 0, **({"derived": derived} if derived else {}),
            **({"thinned": thinned} if thinned else {}),
            **({"links": links} if links else {}),
            **({"referenced": referenced} if referenced else {})}


def _thin(manager: CheckpointManager, names: list[str]) -> list[str]:
    """Thin each of ``names`` into weights only (:func:`shardckpt.checkpoint.thin.thin`); the
    names thinned now (one that cannot be is kept whole and logged)."""
    out = []
    for name in names:
        try:
            if thin(manager.storage.child(name)) is not None:
                out.append(name)
        except ShardckptError as e:
            log.warning("retain did not thin %s: %s", manager.storage.url_of(name), e)
    return out


def _remove(parent: Storage, name: str, first: str | tuple[str, ...],
            links: list[dict[str, str]]) -> bool:
    """Remove ``parent/name``: the files ``first`` (what commits it) first, then the rest;
    False (and the link in ``links``) where it is or lies behind a symbolic link."""
    try:
        for rel in (first,) if isinstance(first, str) else first:
            if parent.exists(f"{name}/{rel}"):
                parent.remove_inside(f"{name}/{rel}")
        parent.remove_inside(name, recursive=True)
    except LinkRefusedError as e:
        log.warning("retain: %s", e)
        links.append({"path": e.link, "target": e.target})
        return False
    return True


def _remove_derived(f: Found, steps: tuple[StepSpec, ...], storage_options: Mapping[str, Any],
                    links: list[dict[str, str]], referenced: list[str]) -> list[str]:
    """Remove the outputs the pipeline's steps derived from the checkpoint ``f``; their URLs."""
    out = []
    for spec in steps:
        url = spec.dst_for(f.step, f.name)
        if url is None or spec.kind not in ("reshard", "consolidate", "copy"):
            continue
        parent_url, name = posixpath.split(url.rstrip("/"))
        if not name or not parent_url:
            continue
        parent = Storage(parent_url, storage_options)
        if not parent.exists(name):
            continue
        if spec.kind == "consolidate":
            first: str | tuple[str, ...] = CONSOLIDATED_FIRST
        else:
            siblings = CheckpointManager(parent)
            kept = [n for n in parent.ls("") if n != name and parent.exists(f"{n}/{MANIFEST_NAME}")]
            if name in siblings.referenced(kept):
                log.info("retain keeps %s: a kept checkpoint beside it references its files", url)
                referenced.append(url)
                continue
            first = MANIFEST_NAME
        if _remove(parent, name, first, links):
            log.info("retain removed %s (step %s's output for %s)", url, spec.key, f.name)
            out.append(url)
    return out
