"""Writer leases: how ``clean`` tells a save in progress from debris, whatever the save's age.

The process that writes a save attempt holds a lease, ``<save-id>/.lease-<token>``: a small JSON
object ``{"expires": <UNIX seconds>, "host": ..., "pid": ...}`` that a background thread rewrites
every ``ttl_s / 3`` seconds while the save runs, and that is removed when the save commits or
fails. A killed writer's lease is not renewed and expires; on the writer's own host (same host
name and PID namespace) it ends as soon as the writer's process is gone. :func:`live_until`
answers whether a save directory holds a live lease; ``clean`` and ``reshard --overwrite`` leave
such a directory alone.

Whoever can write below a prefix can plant a lease, so a lease file is parsed strictly
(:func:`parse_lease`: at most :data:`MAX_LEASE_BYTES`, a flat UTF-8 JSON object, ``expires`` a
finite number of seconds, ``host`` a string, ``pid`` a positive integer below 2**31, ``pidns`` an
integer or null). A file named as a lease that fails those checks counts as a live lease that
never ends, with one warning naming it: the callers are destructive (``clean`` removes what no
lease holds, the watch service starts a step no lease holds), and a planted file must make them
keep something, never remove it or run a step twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any, TypeGuard

from shardckpt.errors import ShardckptError
from shardckpt.format.parse_context import json_object
from shardckpt.storage import NotFoundError, Storage

log = logging.getLogger(__name__)

LEASE_PREFIX = ".lease-"
DEFAULT_TTL_S = 120.0
MAX_LEASE_BYTES = 4096
#: A lease document is one flat object; arrays or objects inside it are refused before parsing.
MAX_LEASE_DEPTH = 1
MAX_PID = 2**31 - 1
#: Expiry times beyond this (about the year 33658) are not a writer's.
MAX_EXPIRES = 1e12


class LeaseError(ShardckptError):
    """A file named as a lease that does not hold a lease document."""


class Lease:
    """A renewed lease on one save directory; use as a context manager around the save."""

    def __init__(self, storage: Storage, save_id: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s {ttl_s}: must be > 0")
        self.storage, self.ttl_s = storage, ttl_s
        self.rel = f"{save_id}/{LEASE_PREFIX}{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        doc = {"expires": time.time() + self.ttl_s, **whoami()}
        self.storage.put(self.rel, json.dumps(doc).encode())

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._write()
            except ShardckptError as e:  # the next renewal may succeed; the save goes on
                log.warning("could not renew the lease %s: %s", self.storage.url_of(self.rel), e)

    def acquire(self) -> Lease:
        """Write the lease and start renewing it. A lease that cannot be written does not stop
        the save (its own writes say what is wrong with the storage); renewals keep trying."""
        try:
            self._write()
        except ShardckptError as e:
            log.warning("could not write the lease %s (%s); until a renewal succeeds, `shardckpt "
                        "clean` judges this save by its age", self.storage.url_of(self.rel), e)
        self._thread = threading.Thread(target=self._renew, name="shardckpt-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stop renewing and remove the lease (best effort: an unremoved lease expires)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.storage.rm(self.rel)
        except ShardckptError as e:
            log.warning("could not remove the lease %s (%s); it expires in %.0f s",
                        self.storage.url_of(self.rel), e, self.ttl_s)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def live_until(storage: Storage, save_dir: str, now: float | None = None) -> float | None:
    """The latest expiry (UNIX seconds) of the unexpired leases in ``save_dir``; None if none.

    A lease file that cannot be read (other than one removed since the listing) or fails
    :func:`parse_lease` counts as live for ever (``math.inf``), with one warning naming it: leases
    are written whole (an atomic rename locally, one PUT on object stores), so such a file is not
    a writer's, and for the destructive callers keeping a directory is the safe mistake. Raises
    nothing but :class:`ShardckptError` (from listing ``save_dir``).
    """
    now = time.time() if now is None else now
    best = None
    for name in storage.ls(save_dir):
        if not name.startswith(LEASE_PREFIX):
            continue
        rel = f"{save_dir}/{name}"
        try:
            doc = parse_lease(storage.read_limited(rel, MAX_LEASE_BYTES))
        except NotFoundError:  # released since the listing
            continue
        except ShardckptError as e:
            _warn_once(storage.url_of(rel), str(e))
            return math.inf
        expires = doc["expires"]
        if expires > now and not _writer_gone(doc) and (best is None or expires > best):
            best = expires
    return best


def parse_lease(data: bytes) -> dict[str, Any]:
    """A lease document, checked (see the module doc); :class:`LeaseError` (one line) if
    ``data`` is not one. Fields other than those named there are kept unchecked."""
    try:
        doc = json_object(data, MAX_LEASE_BYTES, MAX_LEASE_DEPTH, "a lease")
    except ValueError as e:
        raise LeaseError(str(e)) from None
    if "expires" not in doc:
        raise LeaseError("no 'expires'")
    expires = doc["expires"]
    if not _number(expires) or not -MAX_EXPIRES <= expires <= MAX_EXPIRES:  # NaN fails too
        raise LeaseError(f"expires = {_short(repr(expires))}: expected a time in UNIX seconds")
    doc["expires"] = float(expires)
    if "host" in doc and not isinstance(doc["host"], str):
        raise LeaseError(f"host = {_short(repr(doc['host']))}: expected a string")
    pid = doc.get("pid")
    if "pid" in doc and not (_integer(pid) and 0 < pid <= MAX_PID):
        raise LeaseError(f"pid = {_short(repr(pid))}: expected a process id (1 to {MAX_PID})")
    pidns = doc.get("pidns")
    if pidns is not None and not (_integer(pidns) and 0 <= pidns < 2**64):
        raise LeaseError(f"pidns = {_short(repr(pidns))}: expected an inode number or null")
    return doc


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: object, limit: int = 80) -> str:
    """``v`` as a short printable line for a message (an int too long to print says so)."""
    try:
        text = str(v)
    except ValueError:  # an integer past the str() digit limit
        text = "a number too long to print"
    text = text if len(text) <= limit else text[:limit] + "..."
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(where: str, problem: str) -> None:
    """One warning per lease file and problem in this process (a watcher or a status page
    looks at the same step directory again every pass)."""
    with _warned_lock:
        if (where, problem) in _warned:
            return
        if len(_warned) > 4096:
            _warned.clear()
        _warned.add((where, problem))
    log.warning("%s is not a lease that can be read (%s); counting it as held, so nothing it "
                "covers is removed or started until it is removed", _short(where, 1000), _short(problem, 500))


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def whoami() -> dict[str, Any]:
    """This process as a lease names its holder: host, PID namespace and pid."""
    return {"host": socket.gethostname(), "pidns": _pid_namespace(), "pid": os.getpid()}


def _writer_gone(doc: dict[str, Any]) -> bool:
    """Whether the lease's writer is a process of this host and PID namespace that has exited
    (a killed writer's lease then ends at once, not after its expiry). ``doc`` is checked
    (:func:`parse_lease`)."""
    me = whoami()
    pid = doc.get("pid")
    if doc.get("host") != me["host"] or me["pidns"] is None or doc.get("pidns") != me["pidns"]:
        return False
    if not _integer(pid) or not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # exists, owned by another user
        return False
    return False
