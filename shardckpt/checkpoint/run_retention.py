"""Retention per component on a run directory named by a URL: what ``shardckpt clean --keep-*``
and ``shardckpt inspect RUN`` call (:mod:`shardckpt.checkpoint.retention` holds the policy)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.retention import RetentionPolicy, RetentionReport, apply_retention
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.checkpoint.run_names import run_manager
from shardckpt.checkpoint.thin import components_held
from shardckpt.errors import ShardckptError
from shardckpt.format.manifest import Manifest
from shardckpt.storage import Storage


def retain_run(run_url: str, policy: RetentionPolicy, dry_run: bool = False,
               storage_options: Any = None) -> RetentionReport:
    """``shardckpt clean RUN --keep-last ...``: apply ``policy`` to the run directory ``run_url``
    (its ``step-XXXXXXXX`` checkpoints), as a :class:`~shardckpt.checkpoint.run_dir.CheckpointManager`
    of the run would after a save."""
    return apply_retention(CheckpointManager(run_url, storage_options=storage_options), policy,
                           dry_run=dry_run)


def run_holdings(run: str | Storage, storage_options: Any = None,
                 known: Mapping[str, Manifest] | None = None) -> list[dict[str, Any]]:
    """What each committed checkpoint of the run directory ``run`` (a URL, or its storage open
    already) holds, oldest first: ``name``, ``step``, ``holds``
    (:func:`~shardckpt.checkpoint.thin.components_held`; a manifest that does not read is
    ``["unreadable: <why>"]``). ``known``: manifests the caller has read already, by URL (not
    read again)."""
    manager = run_manager(run if isinstance(run, Storage) else Storage(run, storage_options))
    known = known or {}
    out = []
    for f in manager.committed():
        try:
            m = known.get(manager.storage.url_of(f.name))
            holds = components_held(m if m is not None else read_manifest(manager.storage.child(f.name)))
        except ShardckptError as e:
            holds = [f"unreadable: {e}"]
        out.append({"name": f.name, "step": f.step, "holds": holds})
    return out
