"""Writer leases: how ``clean`` tells a save in progress from debris, whatever the save's age.

The process that writes a save attempt holds a lease, ``<save-id>/.lease-<token>``: a small JSON
object ``{"expires": <UNIX seconds>, "host": ..., "pid": ...}`` that a background thread rewrites
every ``ttl_s / 3`` seconds while the save runs, and that is removed when the save commits or
fails. A killed writer's lease is not renewed and expires; on the writer's own host (same host
name and PID namespace) it ends as soon as the writer's process is gone. :func:`live_until`
answers whether a save directory holds a live lease; ``clean`` and ``reshard --overwrite`` leave
such a directory alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from shardckpt.errors import ShardckptError
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

LEASE_PREFIX = ".lease-"
DEFAULT_TTL_S = 120.0
MAX_LEASE_BYTES = 4096


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

    def acquire(self) -> "Lease":
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

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def live_until(storage: Storage, save_dir: str, now: float | None = None) -> float | None:
    """The latest expiry (UNIX seconds) of the unexpired leases in ``save_dir``; None if none.

    A lease that cannot be read or parsed counts as no lease: leases are written whole (an
    atomic rename locally, one PUT on object stores), so such a file is not a writer's.
    """
    now = time.time() if now is None else now
    best = None
    for name in storage.ls(save_dir):
        if not name.startswith(LEASE_PREFIX):
            continue
        try:
            doc = json.loads(storage.read_limited(f"{save_dir}/{name}", MAX_LEASE_BYTES))
            expires = float(doc["expires"])
        except (ShardckptError, ValueError, KeyError, TypeError):
            continue
        if expires > now and not _writer_gone(doc) and (best is None or expires > best):
            best = expires
    return best


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
    (a killed writer's lease then ends at once, not after its expiry)."""
    me = whoami()
    pid = doc.get("pid")
    if doc.get("host") != me["host"] or me["pidns"] is None or doc.get("pidns") != me["pidns"]:
        return False
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by another user
        return False
    return False
