"""Which local-tier steps belong to this run.

A node directory outlives its job: the next job on the node may be another run (another durable
URL, another model) given the same ``LocalTier.path``. Each local save records the run's
identity in its manifest (``extras.run``: the durable run URL), and resume counts a local step
only where that identity is the resuming run's; any other step is left where it is (not
deleted: it may be someone's evidence, and the node's pruning skips it) and named in one
warning with the reason.
"""

from __future__ import annotations

import logging
from typing import Any

from shardckpt.checkpoint.collective import agree, same_error
from shardckpt.checkpoint.manifest_memo import parsed
from shardckpt.checkpoint.run_dir import STEP_DIR, step_dir
from shardckpt.checkpoint.tiers import LocalTier, node_storage
from shardckpt.errors import CollectiveError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from shardckpt.format.records import run_extras
from shardckpt.storage import Storage

log = logging.getLogger(__name__)


def private_node(tier: LocalTier, node: int, group: Any) -> Storage:
    """``node``'s directory of ``tier``, created ``0700`` and checked (another user's, or one
    others may write, is refused) on every rank, which then agree: a refusal on any node is the
    same error on every rank (collective on ``group``)."""
    try:
        storage, _ = agree(lambda: node_storage(tier, node), "local tier directory check", group)
    except CollectiveError as e:
        raise same_error(e, "local tier directory check") from e
    assert storage is not None
    return storage


def run_identity(durable_url: str) -> str:
    """The identity a run's local steps record: its durable URL, without a trailing slash."""
    return durable_url.rstrip("/") or durable_url


def foreign_reason(storage: Storage, step: int, run: str) -> str | None:
    """Why committed local ``step`` in the node directory ``storage`` is not this ``run``'s;
    None where it is."""
    here = storage.child(step_dir(step))
    try:
        m = parsed(here.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES), here.url_of(MANIFEST_NAME))
        theirs = run_extras(m, here.url_of(MANIFEST_NAME)).run
    except ShardckptError as e:
        return f"its manifest is unreadable ({e})"
    if theirs is None:
        return "it records no run identity (written by another job or an older shardckpt)"
    if theirs != run:
        return f"it belongs to run {theirs!r}, not {run!r}"
    return None


def foreign_steps(storage: Storage, run: str) -> set[str]:
    """The committed step directories of the node directory ``storage`` that another run
    wrote: the node's pruning neither counts nor removes them."""
    out = set()
    for name in storage.ls(""):
        m = STEP_DIR.match(name)
        if m and storage.exists(f"{name}/{MANIFEST_NAME}") and foreign_reason(storage, int(m.group(1)), run):
            out.add(name)
    return out


def own_holdings(storage: Storage, held: dict[str, Any], run: str) -> dict[str, Any]:
    """``held`` (:func:`~shardckpt.checkpoint.tiers.holdings` of ``storage``) less the committed
    steps another run wrote, each named in a warning."""
    out = {}
    for key, info in held.items():
        why = foreign_reason(storage, int(key), run) if info.get("manifest") is not None else None
        if why is None:
            out[key] = info
        else:
            log.warning("local tier: not resuming from %s: %s", storage.url_of(step_dir(int(key))), why)
    return out
