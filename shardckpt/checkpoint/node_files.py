"""A node's checkpoints that share files: a local step whose frozen files did not change since
the node's previous committed step references them there (``../step-XXXXXXXX/<save-id>/frozen-…``,
docs/FORMAT.md section 15), as the durable tier does, instead of writing and copying them again.

Rules (the local tier's, beside those of :mod:`shardckpt.checkpoint.tiers`):

* a save references the previous step only where that step is the newest committed one on every
  node with the same save id (so every node that must hold a frozen file, its writer's and its
  peers', holds it: each node committed that step only once it held its files);
* a node's commit checks that the files it must hold, referenced ones included, are there;
* pruning keeps a step that a kept step references (references never chain: a reference copies
  an earlier reference, so one level suffices);
* a resume counts a referenced file as held where the referenced step's directory holds it, and
  fetches a missing one into that step's directory (a path below the node's directory with no
  ``..``: :func:`below_node`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from shardckpt.checkpoint.manifest_memo import parsed
from shardckpt.checkpoint.references import RunFiles, referenced_steps_in
from shardckpt.checkpoint.run_dir import STEP_DIR
from shardckpt.errors import ShardckptError
from shardckpt.format.manifest import FROZEN_ROLE, MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, reference_of
from shardckpt.storage import NotFoundError, Storage

log = logging.getLogger(__name__)


def below_node(path: str) -> str:
    """Where a file a manifest names (own, or a reference) lies below its node's directory, for
    a step directory ``step``: a reference ``../step-P/x`` -> ``step-P/x``; an own path is the
    caller's to prefix."""
    return path[3:] if path.startswith("../") else path


def newest_committed(storage: Storage, shards: Iterable[int]) -> list[Any] | None:
    """``[step, save id]`` of the newest step with a manifest that parses in a node's directory,
    where the node holds that step's frozen files of shard ranks ``shards`` whole (the ones it
    must hold: its ranks' own and its copies of other nodes'), else None (JSON, for an agreement
    of the ranks). A node resumed from peers may hold a step without all of them: then the next
    save writes and copies them again."""
    steps = sorted(((int(m.group(1)), n) for n in storage.ls("") if (m := STEP_DIR.match(n))),
                   reverse=True)
    for step, name in steps:
        try:
            data = storage.read_limited(f"{name}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
        except NotFoundError:
            continue
        try:
            man = parsed(data, storage.url_of(f"{name}/{MANIFEST_NAME}"))
            files = RunFiles(storage.child(name))
            frozen = {f.index: f for f in man.files if f.role == FROZEN_ROLE}
            if all(s in frozen and files.size(frozen[s].path) == frozen[s].size for s in shards):
                return [step, man.save_id]
        except ShardckptError:
            pass  # damaged, or a file gone: reference nothing
        return None
    return None


def held_whole(held: Mapping[str, Any], step: int, m: Manifest) -> set[str]:
    """The files of ``m`` (local step ``step``) that one node's
    :func:`~shardckpt.checkpoint.tiers.holdings` shows whole (their recorded size): its own
    below the step's directory, a referenced one below the referenced step's."""
    out = set()
    for f in m.files:
        ref = reference_of(f.path) if f.is_reference else None
        if ref is None:
            files = held.get(str(step), {}).get("files", {})
            rel = f.path
        else:
            key = str(int(STEP_DIR.match(ref[0]).group(1)))  # type: ignore[union-attr]
            files = held.get(key, {}).get("files", {})
            rel = f.path.split("/", 2)[2]
        if files.get(rel) == f.size:
            out.add(f.path)
    return out


def prune(storage: Storage, keep: int, skip: Collection[str] = ()) -> list[str]:
    """Keep a node's newest ``keep`` committed steps, and the steps they reference; remove older
    ones (manifest first, so a half-removed step never looks committed) and uncommitted steps
    older than the newest committed one; the steps named in ``skip`` (another run's) are neither
    counted nor removed. Returns the names removed."""
    steps = sorted((int(m.group(1)), n) for n in storage.ls("")
                   if (m := STEP_DIR.match(n)) and n not in skip)
    committed = [s for s, n in steps if storage.exists(f"{n}/{MANIFEST_NAME}")]
    if not committed:
        return []
    kept = set(committed[-keep:])
    needed: set[str] = set()
    for s, n in steps:
        if s in kept:
            try:
                needed |= referenced_steps_in(storage.read_limited(f"{n}/{MANIFEST_NAME}",
                                                                   MAX_MANIFEST_BYTES))
            except ShardckptError as e:
                log.warning("local tier: %s unreadable (%s); keeping every step", storage.url_of(n), e)
                return []
    newest = committed[-1]
    removed = []
    for s, n in steps:
        if s in kept or n in needed or (s not in committed and s > newest):
            continue
        try:
            storage.remove_inside(f"{n}/{MANIFEST_NAME}")
            storage.remove_inside(n, recursive=True)
        except (NotFoundError, ShardckptError) as e:
            log.warning("local tier: could not remove %s: %s", storage.url_of(n), e)
            continue
        removed.append(n)
    return removed
