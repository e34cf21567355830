"""Progress records of a pipeline, kept in the store beside its outputs.

Below ``<state>/.watch/<pipeline>/<checkpoint>/`` (``<checkpoint>`` is ``step-XXXXXXXX``), for
the step ``<i>-<kind>`` (``i`` counts from 1 in pipeline order):

* ``<i>-<kind>.done``: the step finished; JSON with its times, bytes, output and the output's
  identity (save id). Create-only: written once, after the step's output committed.
* ``<i>-<kind>.dead``: the step failed after its retries; JSON whose ``reason`` is one line.
  Create-only. The checkpoint's later steps do not run; later checkpoints are not held up.
* ``<i>-<kind>/.lease-claim-<n>``: attempt ``n`` of the step, created create-only, so that of
  two watchers that try the same attempt exactly one wins; it holds a lease document (expiry,
  host, PID) as :mod:`shardckpt.storage.lease` writes them, rewritten as expired when the attempt ends.
* ``<i>-<kind>/.lease-<token>``: the running attempt's lease (:class:`shardckpt.storage.lease.Lease`),
  renewed every third of its life and removed when the attempt ends.

A step is *held* while the newest claim or a lease in its directory is live
(:func:`shardckpt.storage.lease.live_until`: unexpired, and its writer's process alive where that can be
told); a watcher starts a step only after winning a fresh claim and seeing no ``.done``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from shardckpt.errors import CommitConflictError, ShardckptError
from shardckpt.storage.lease import LEASE_PREFIX, Lease, whoami, live_until
from shardckpt.storage import NotFoundError, Storage

log = logging.getLogger(__name__)

WATCH_DIR = ".watch"
MAX_RECORD_BYTES = 1 << 16
_CLAIM = re.compile(rf"^{re.escape(LEASE_PREFIX)}claim-(\d+)\Z")


def pipeline_dir(pipeline: str) -> str:
    return f"{WATCH_DIR}/{pipeline}"


def checkpoint_dir(pipeline: str, checkpoint: str) -> str:
    return f"{WATCH_DIR}/{pipeline}/{checkpoint}"


@dataclass(frozen=True)
class StepState:
    """What the records say of one step of one checkpoint."""

    key: str
    state: str                      # done | dead | running | pending
    record: dict[str, Any] | None = None


def read_record(storage: Storage, rel: str) -> dict[str, Any] | None:
    """The JSON body of a record, None if absent; an unreadable body is reported, not trusted."""
    try:
        data = storage.read_limited(rel, MAX_RECORD_BYTES)
    except NotFoundError:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return {"unreadable": True}
    return doc


def write_record(storage: Storage, rel: str, doc: dict[str, Any]) -> bool:
    """Create ``rel`` with ``doc``; False if a record is there already (another watcher's)."""
    try:
        storage.create_only(rel, json.dumps(doc, indent=1, sort_keys=True).encode())
    except CommitConflictError:
        log.warning("%s exists already: another watcher recorded this step", storage.url_of(rel))
        return False
    return True


def write_done(storage: Storage, pipeline: str, checkpoint: str, key: str, doc: dict[str, Any]) -> bool:
    return write_record(storage, f"{checkpoint_dir(pipeline, checkpoint)}/{key}.done", doc)


def write_dead(storage: Storage, pipeline: str, checkpoint: str, key: str, doc: dict[str, Any]) -> bool:
    return write_record(storage, f"{checkpoint_dir(pipeline, checkpoint)}/{key}.dead", doc)


def step_states(storage: Storage, pipeline: str, checkpoint: str, keys: list[str],
                names: list[str] | None = None, bodies: bool = False) -> dict[str, StepState]:
    """The state of each step ``keys`` of ``checkpoint`` from one listing of its record
    directory (``names``, when the caller listed it already), plus a listing per step directory
    that exists (lease checks) and, with ``bodies``, a read per record."""
    base = checkpoint_dir(pipeline, checkpoint)
    names = storage.ls(base) if names is None else names
    present = set(names)
    out: dict[str, StepState] = {}
    for key in keys:
        for suffix, state in ((".done", "done"), (".dead", "dead")):
            if key + suffix in present:
                body = read_record(storage, f"{base}/{key}{suffix}") if bodies else None
                out[key] = StepState(key, state, body)
                break
        else:
            held = key in present and live_until(storage, f"{base}/{key}") is not None
            out[key] = StepState(key, "running" if held else "pending")
    return out


class StepClaim:
    """The right to run one step once: a won create-only claim, then a renewed lease.

    :meth:`try_claim` returns None when the step is done, dead, or held by a live claim or
    lease; otherwise it creates the next claim (create-only: of two watchers, one wins) and
    starts the lease. :meth:`release` stops and removes the lease.
    """

    def __init__(self, storage: Storage, pipeline: str, checkpoint: str, key: str,
                 ttl_s: float) -> None:
        self.storage, self.ttl_s = storage, ttl_s
        self.base = checkpoint_dir(pipeline, checkpoint)
        self.dir = f"{self.base}/{key}"
        self.key = key
        self.lease: Lease | None = None
        self.attempt = 0

    def settled(self) -> str | None:
        for suffix, state in ((".done", "done"), (".dead", "dead")):
            if self.storage.exists(f"{self.base}/{self.key}{suffix}"):
                return state
        return None

    def try_claim(self) -> bool:
        names = self.storage.ls(self.dir)
        if live_until(self.storage, self.dir) is not None:
            return False
        if self.settled():  # after the lease check: a holder records before it releases
            return False
        n = 1 + max((int(m.group(1)) for m in map(_CLAIM.match, names) if m), default=0)
        doc = {"expires": time.time() + self.ttl_s, **whoami()}
        try:
            self.storage.create_only(f"{self.dir}/{LEASE_PREFIX}claim-{n:04d}", json.dumps(doc).encode())
        except CommitConflictError:
            return False
        self.attempt = n
        self.lease = Lease(self.storage, self.dir, self.ttl_s).acquire()
        if self.settled():  # recorded between our checks and our claim
            self.release()
            return False
        return True

    def release(self) -> None:
        """Stop and remove the lease, and expire the claim (its name stays taken, so the next
        attempt claims the next number); best effort: an unexpired claim runs out by itself."""
        if self.lease is None:
            return
        self.lease.release()
        self.lease = None
        rel = f"{self.dir}/{LEASE_PREFIX}claim-{self.attempt:04d}"
        try:
            self.storage.put(rel, json.dumps({"expires": 0, "released": True, **whoami()}).encode())
        except ShardckptError as e:
            log.warning("could not release the claim %s (%s); it expires in %g s",
                        self.storage.url_of(rel), e, self.ttl_s)


def record_names(storage: Storage, pipeline: str) -> list[str]:
    """The checkpoints that have a record directory."""
    try:
        return storage.ls(pipeline_dir(pipeline))
    except ShardckptError:
        return []
