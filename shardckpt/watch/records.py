"""Progress records of a pipeline, kept in the store beside its outputs.

Below ``<state>/.watch/<pipeline>/<checkpoint>/`` (``<checkpoint>``: ``step-XXXXXXXX``,
``checkpoint-<N>`` or Lightning's ``epoch=<E>-step=<N>.ckpt``, :func:`checkpoint_step`), for
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

Whoever can write below the state prefix can plant records, so a record is read as untrusted
input (:func:`parse_record`): at most :data:`MAX_RECORD_BYTES`, nesting at most
:data:`MAX_RECORD_DEPTH` deep (checked before parsing), UTF-8 JSON without NaN, infinities or
repeated keys, every known field of its type and range, and naming the checkpoint and step it
lies under. A record that fails is *unreadable*: the step is neither run (its record's name is
taken, and records are create-only, so a rerun could never be recorded and might replace an
output the record describes) nor counted done (later steps would build on an output that may not
exist, and ``retain`` could remove the source). The checkpoint waits, the status shows the
record as ``unreadable`` with the reason, and one warning names it; removing the bad record lets
the next pass go on (a committed output is then adopted, not rewritten).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from shardckpt.checkpoint.run_names import STEP, checkpoint_name
from shardckpt.errors import CommitConflictError, ShardckptError
from shardckpt.format.parse_context import json_object
from shardckpt.storage import LEASE_PREFIX, Lease, whoami, live_until, NotFoundError, Storage

log = logging.getLogger(__name__)

WATCH_DIR = ".watch"
MAX_RECORD_BYTES = 1 << 16
#: A record is an object of scalars and short lists (of names, or of objects of names).
MAX_RECORD_DEPTH = 4
_CLAIM = re.compile(rf"{re.escape(LEASE_PREFIX)}claim-([0-9]{{1,12}})")
_CHECKPOINT = re.compile(r"step-([0-9]{8,20})")
_MAX_INT = 2**63 - 1
_MAX_SECONDS = 1e12


class RecordError(ShardckptError):
    """A progress record that cannot be read, or does not hold what such a record holds."""


def printable(value: object, limit: int = 2000) -> str:
    """``value`` as one line of printable text, for logs and the status: control characters (a
    newline, an escape sequence), lone surrogates and other unprintable characters come out as
    backslash escapes; longer than ``limit`` characters, it is cut and marked."""
    text = str(value)
    cut = len(text) > limit
    text = text[:limit]
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                       for ch in text)
    return text + " [...]" if cut else text


def checkpoint_step(name: object) -> int | None:
    """The step of a checkpoint directory name of any layout shardckpt writes
    (:mod:`shardckpt.checkpoint.run_names`: ``step-`` and 8 to 20 ASCII digits, the Trainer's
    ``checkpoint-<N>``, Lightning's ``...step=<N>....ckpt``); None for any other name, which the
    watch service ignores."""
    found = checkpoint_name(name)
    if found is None or (found[0] is STEP and not _CHECKPOINT.fullmatch(str(name))):
        return None
    return found[1]


def pipeline_dir(pipeline: str) -> str:
    return f"{WATCH_DIR}/{pipeline}"


def checkpoint_dir(pipeline: str, checkpoint: str) -> str:
    return f"{WATCH_DIR}/{pipeline}/{checkpoint}"


@dataclass(frozen=True)
class StepState:
    """What the records say of one step of one checkpoint; ``problem`` (one line, naming the
    record) says why an ``unreadable`` one was refused."""

    key: str
    state: str                      # done | dead | running | pending | unreadable
    record: dict[str, Any] | None = None
    problem: str | None = None


# ------------------------------------------------------------------------------ parsing


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _opt_text(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_INT


def _opt_count(v: Any) -> bool:
    return v is None or _count(v)


def _seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        and abs(v) <= _MAX_SECONDS


def _flag(v: Any) -> bool:
    return isinstance(v, bool)


def _names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "pipeline": (_text, "a string"), "checkpoint": (_text, "a string"), "kind": (_text, "a string"),
    "step": (_count, "a count"), "index": (_count, "a count"), "claim": (_count, "a count"),
    "host": (_text, "a string"), "pid": (_count, "a count"), "pidns": (_opt_count, "a count"),
    "tries": (_count, "a count"), "started": (_seconds, "a time"),
    "finished": (_seconds, "a time"), "seconds": (_seconds, "a number of seconds"),
    "bytes": (_count, "a count"), "output": (_opt_text, "a string"),
    "identity": (_opt_text, "a string"), "source_save_id": (_opt_text, "a string"),
    "adopted": (_flag, "true or false"), "removed": (_names, "a list of names"),
    "referenced": (_names, "a list of names"), "derived": (_names, "a list of names"),
    "thinned": (_names, "a list of names"),
    "reason": (_text, "a string"),
}
_REQUIRED = {
    "done": ("checkpoint", "kind", "index", "tries", "finished", "seconds", "bytes"),
    "dead": ("checkpoint", "kind", "index", "tries", "finished", "reason"),
}


def parse_record(data: bytes, state: str, checkpoint: str | None = None,
                 key: str | None = None) -> dict[str, Any]:
    """The body of a ``state`` (``done`` or ``dead``) record, checked; :class:`RecordError` (one
    line, without the record's location) if it is not one. With ``checkpoint`` and ``key``,
    the record must also name that checkpoint and that step (``<index>-<kind>``)."""
    try:
        doc = json_object(data, MAX_RECORD_BYTES, MAX_RECORD_DEPTH, "a record")
    except ValueError as e:
        raise RecordError(str(e)) from None
    for name in _REQUIRED[state]:
        if name not in doc:
            raise RecordError(f"no {name!r}: a {state} record names it")
    for name, value in doc.items():
        check = _FIELDS.get(name)
        if check is not None and not check[0](value):
            raise RecordError(f"{name} = {printable(repr(value), 80)}: expected {check[1]}")
    if checkpoint is not None and doc["checkpoint"] != checkpoint:
        raise RecordError(f"it names the checkpoint {printable(repr(doc['checkpoint']), 80)}, "
                          f"not {checkpoint}, whose record it is")
    if key is not None and f"{doc['index']}-{doc['kind']}" != key:
        raise RecordError(f"it names the step {printable(repr(doc['index']), 40)}-"
                          f"{printable(doc['kind'], 40)}, not {key}, whose record it is")
    return doc


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(where: str, problem: str) -> None:
    """One warning per record and problem in this process (a status page polled every 10 s
    must not repeat it)."""
    with _warned_lock:
        if (where, problem) in _warned:
            return
        if len(_warned) > 4096:
            _warned.clear()
        _warned.add((where, problem))
    log.warning("unreadable watch record %s: %s", printable(where), problem)


def read_record(storage: Storage, rel: str, checkpoint: str | None = None,
                key: str | None = None) -> dict[str, Any] | None:
    """The checked body of the record ``rel`` (``<key>.done`` or ``<key>.dead``), None if
    absent; :class:`RecordError` (one line, naming the record) if it is unreadable: too large,
    not a file, or not a record (:func:`parse_record`). Logs one warning naming the record."""
    state = "done" if rel.endswith(".done") else "dead"
    try:
        data = storage.read_prefix(rel, MAX_RECORD_BYTES + 1)
        doc = parse_record(data, state, checkpoint, key)
    except NotFoundError:
        return None
    except ShardckptError as e:
        where = storage.url_of(rel)
        problem = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        problem = printable(problem.removeprefix(f"{where}: "), 500)
        _warn_once(where, problem)
        raise RecordError(f"{printable(where)}: {problem}") from None
    return doc


def held(storage: Storage, rel: str) -> bool:
    """Whether a live claim or lease holds the step directory ``rel``. A lease file that makes
    the lease reader fail (too deep, a number too large to compare) counts as held: that stops
    no one for longer than a valid lease with a far expiry would, and never starts a step
    twice."""
    try:
        return live_until(storage, rel) is not None
    except ShardckptError:
        raise
    except (RecursionError, OverflowError, ValueError, TypeError, KeyError, AttributeError) as e:
        _warn_once(storage.url_of(rel), f"a lease there cannot be read ({type(e).__name__}); "
                   "the step counts as held")
        return True


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
                names: list[str] | None = None) -> dict[str, StepState]:
    """The state of each step ``keys`` of ``checkpoint`` from one listing of its record
    directory (``names``, when the caller listed it already), a read per record (a record that
    fails :func:`read_record` makes its step ``unreadable``) and a listing per step directory
    that exists (lease checks)."""
    base = checkpoint_dir(pipeline, checkpoint)
    names = storage.ls(base) if names is None else names
    present = set(names)
    out: dict[str, StepState] = {}
    for key in keys:
        for suffix, state in ((".done", "done"), (".dead", "dead")):
            if key + suffix in present:
                try:
                    body = read_record(storage, f"{base}/{key}{suffix}", checkpoint, key)
                except RecordError as e:
                    out[key] = StepState(key, "unreadable", problem=str(e))
                    break
                if body is None:  # removed since the listing
                    continue
                out[key] = StepState(key, state, body)
                break
        else:
            running = key in present and held(storage, f"{base}/{key}")
            out[key] = StepState(key, "running" if running else "pending")
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
        """"done" or "dead" after the step's record, "unreadable" if that record fails
        :func:`read_record`, None if there is none."""
        for suffix, state in ((".done", "done"), (".dead", "dead")):
            if self.storage.exists(f"{self.base}/{self.key}{suffix}"):
                checkpoint = self.base.rsplit("/", 1)[-1]
                try:
                    if read_record(self.storage, f"{self.base}/{self.key}{suffix}", checkpoint,
                                   self.key) is None:
                        continue
                except RecordError:
                    return "unreadable"
                return state
        return None

    def try_claim(self) -> bool:
        names = self.storage.ls(self.dir)
        if held(self.storage, self.dir):
            return False
        if self.settled():  # after the lease check: a holder records before it releases
            return False
        n = 1 + max((int(m.group(1)) for m in map(_CLAIM.fullmatch, names) if m), default=0)
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
