"""Which checkpoints a Lightning run may delete, and which paths its restored state may name.

A checkpoint's author is not trusted, and Lightning's ``ModelCheckpoint`` keeps paths in the state
it saves (``best_model_path``, ``last_model_path``, ``kth_best_model_path``, the keys of
``best_k_models``): restored, they become what it hands the strategy's ``remove_checkpoint`` at
the next save. Lightning checks a local path only lexically (``dirpath/../../x`` passes) and a URL
(``s3://...``) not at all. So:

* :func:`confine_restored` checks each of those paths in the state a load returns against the
  live callback's own ``dirpath`` (the operator's, never read from the checkpoint): a path is
  kept only if it is ``<dirpath>/<name>``, ``name`` one plain component, and the listing of
  ``dirpath`` holds a committed checkpoint of that name. Any other is dropped, with a warning
  naming it; ``best_k_models`` and its ``kth_*`` stay consistent.
* :func:`remove_checkpoint` with ``within`` (the strategy passes its callbacks' directories)
  deletes only such a checkpoint, through the confined delete
  (:meth:`~shardckpt.storage.Storage.remove_inside`); anything else is kept, with a warning.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any
from collections.abc import Iterable, Mapping

from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.run_dir import CheckpointManager, Found
from shardckpt.errors import ConfigError, LinkRefusedError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.records import run_extras
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

__all__ = ["confine_restored", "listed_checkpoint", "newest_good", "remove_checkpoint"]

#: The entries of ``ModelCheckpoint.state_dict()`` that hold one path each.
PATH_FIELDS = ("best_model_path", "last_model_path", "kth_best_model_path")


class _Listings:
    """The committed checkpoints directly below each trusted directory, listed once."""

    def __init__(self, storage_options: Mapping[str, Any] | None) -> None:
        self.options = dict(storage_options or {})
        self.seen: dict[str, set[str]] = {}

    def committed(self, directory: str) -> set[str]:
        if directory not in self.seen:
            storage = Storage(directory, self.options)
            try:
                self.seen[directory] = {n for n in storage.ls("")
                                        if storage.exists(f"{n}/{MANIFEST_NAME}")}
            except ShardckptError as e:
                log.warning("could not list %s: %s", directory, e)
                self.seen[directory] = set()
        return self.seen[directory]


def _name_in(path: str, directory: str) -> str | None:
    """``name`` where ``path`` is ``<directory>/<name>``, one plain component; else None."""
    base = directory.rstrip("/")
    if not base or not path.startswith(base + "/"):
        return None
    name = path[len(base) + 1:]
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
        return None
    return name


def listed_checkpoint(path: Any, directories: Iterable[str],
                      storage_options: Mapping[str, Any] | None = None,
                      listings: _Listings | None = None) -> tuple[str, str] | None:
    """(directory, name) where ``path`` is a committed checkpoint that the listing of one of the
    trusted ``directories`` finds directly below it; None for anything else."""
    if not isinstance(path, str):
        return None
    listings = listings or _Listings(storage_options)
    for directory in directories:
        name = _name_in(path, directory)
        if name is not None and name in listings.committed(directory):
            return directory.rstrip("/"), name
    return None


def confine_restored(checkpoint: Mapping[str, Any], callbacks: Iterable[Any],
                     storage_options: Mapping[str, Any] | None, source: str) -> list[str]:
    """Drop, from the ``ModelCheckpoint`` states in ``checkpoint["callbacks"]`` that a live
    callback of ``callbacks`` will load, every path that is not a committed checkpoint listed in
    that callback's ``dirpath`` (module doc); each drop is logged as a warning. Returns the paths
    dropped (``repr`` of non-strings)."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict):
        return []
    listings = _Listings(storage_options)
    dropped: list[str] = []
    for cb in callbacks:
        state = states.get(getattr(cb, "state_key", None))
        dirpath = getattr(cb, "dirpath", None)
        if isinstance(state, dict) and isinstance(dirpath, str):
            _confine_one(state, dirpath, getattr(cb, "mode", "min"), listings, source, dropped)
    return dropped


def _confine_one(state: dict[str, Any], dirpath: str, mode: str, listings: _Listings,
                 source: str, dropped: list[str]) -> None:
    """:func:`confine_restored` for one callback's state, in place."""

    def ok(p: Any, where: str) -> bool:
        if p is None or (isinstance(p, str) and not p) \
                or listed_checkpoint(p, [dirpath], listings=listings) is not None:
            return True
        dropped.append(p if isinstance(p, str) else repr(p))
        log.warning("%s: ModelCheckpoint %s %r dropped: it is not a committed checkpoint in the "
                    "run's checkpoint directory %s, and a path read from a checkpoint is never "
                    "deleted", source, where, p, dirpath)
        return False

    for fld in PATH_FIELDS:
        if fld in state and not ok(state[fld], fld):
            state[fld] = ""
    topk = state.get("best_k_models")
    if topk is not None:
        kept = {p: s for p, s in topk.items() if ok(p, "best_k_models key")} \
            if isinstance(topk, dict) else {}
        state["best_k_models"] = kept
        if state.get("kth_best_model_path") not in kept:  # Lightning pops it at the next save
            _reset_kth(state, kept, mode)


def _score(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        return float("nan")


def _reset_kth(state: dict[str, Any], topk: dict[str, Any], mode: str) -> None:
    """``kth_best_model_path`` / ``kth_value`` of what is left of ``best_k_models``."""
    if not topk:
        state["kth_best_model_path"] = ""
        return
    worst = max if mode == "min" else min
    kth = worst(topk, key=lambda p: _score(topk[p]))
    state["kth_best_model_path"], state["kth_value"] = kth, topk[kth]


# ------------------------------------------------------------------------------- retention


def _split_url(url: str) -> tuple[str, str]:
    url = url.rstrip("/")
    parent, name = posixpath.split(url)
    if not name or not parent:
        raise ConfigError(f"{url!r} names no checkpoint inside a directory")
    return parent, name


def newest_good(parent: Storage) -> list[str]:
    """Names of the newest good checkpoints directly below ``parent``: committed, every file
    present at its recorded size, and latest by commit time, then step (several only where
    they tie)."""
    manager = CheckpointManager(parent)
    best: tuple[str, int] | None = None
    names: list[str] = []
    for name in parent.ls(""):
        if not parent.exists(f"{name}/{MANIFEST_NAME}"):
            continue
        try:
            m = read_manifest(parent.child(name))
            step = run_extras(m).step or 0
        except ShardckptError:
            continue
        if manager.check(Found(step, name, parent.url_of(name))):
            continue
        rank = (m.created_at, step)
        if best is None or rank > best:
            best, names = rank, [name]
        elif rank == best:
            names.append(name)
    return names


def remove_checkpoint(url: str, storage_options: Mapping[str, Any] | None = None,
                      within: Iterable[str] | None = None) -> bool:
    """Delete the checkpoint at ``url`` (manifest first, then its directory), confined to its
    parent directory and never following a link; True if it was deleted. The newest good
    checkpoint in that directory is kept (logged) unless another as new remains; so is one behind
    a symbolic link. With ``within`` (trusted directories), ``url`` must also be a committed
    checkpoint that the listing of one of them finds directly below it, or it is kept (a
    warning): a path read from a checkpoint never names what is deleted."""
    if within is not None:
        within = list(within)
        found = listed_checkpoint(url, within, storage_options)
        if found is None:
            log.warning("kept %s: not a committed checkpoint listed in the run's checkpoint "
                        "directories (%s); nothing else is ever deleted", url, ", ".join(within))
            return False
        parent_url, name = found
    else:
        parent_url, name = _split_url(url)
    parent = Storage(parent_url, storage_options)
    newest = newest_good(parent)
    if newest == [name]:
        log.warning("kept %s: it is the newest good checkpoint in %s", url, parent_url)
        return False
    try:
        parent.remove_inside(f"{name}/{MANIFEST_NAME}")
        removed = parent.remove_inside(name, recursive=True)
    except LinkRefusedError as e:
        log.warning("kept %s: %s", url, e)
        return False
    log.info("removed %s", url)
    return removed
