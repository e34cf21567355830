"""A file kept allocated in a local directory between two writes of about its size: the next
shard file of a node-local tier's save.

Writing a new file costs the file system a page allocation, zeroed, for every page besides the
copy itself: on tmpfs about 40 % of a save's write (four writers of 244 MB each, two cores:
0.21 s into new files, 0.12 s over allocated ones). A :class:`Spare` is allocated and written
with zeros (:mod:`.prealloc`) after a save, in the background, and the next save's write takes
it over (:meth:`~shardckpt.storage.Storage.write_opener`): renamed into place, written over, cut
to the written size. A spare lives outside every step directory, so nothing takes it for a
checkpoint; it holds no checkpoint bytes anyone reads (zeros, or an earlier save's).
"""

from __future__ import annotations

import logging
import threading

from shardckpt.errors import ShardckptError
from shardckpt.storage.core import Storage

log = logging.getLogger(__name__)


class Spare:
    """One preallocated file ``rel`` below a local ``storage``; ready or not, taken once."""

    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage, self.rel = storage, rel
        self._lock = threading.Lock()
        self._ready = 0  # its size once allocated; 0 while none is ready

    @property
    def nbytes(self) -> int:
        """The size of the spare ready to be taken (0: none)."""
        return self._ready

    def prepare(self, nbytes: int) -> bool:
        """Allocate ``nbytes`` (replacing the spare there was); False, and none, where the file
        system refuses (no room: the next write makes a new file, as without a spare)."""
        with self._lock:
            self._ready = 0
        try:
            self.storage.preallocate(self.rel, nbytes)
        except ShardckptError as e:
            log.info("no spare file %s (%s); the next save writes a new file",
                     self.storage.url_of(self.rel), e)
            self.discard()
            return False
        with self._lock:
            self._ready = nbytes
        return True

    def claim(self) -> str | None:
        """The path of the spare, now the caller's to rename into place; None where none is ready."""
        with self._lock:
            ready, self._ready = self._ready, 0
        return self.storage.full(self.rel) if ready else None

    def discard(self) -> None:
        """Remove the spare, if any (its room goes back to the file system)."""
        with self._lock:
            self._ready = 0
        try:
            self.storage.remove_inside(self.rel)
        except ShardckptError as e:
            log.warning("could not remove the spare file %s: %s", self.storage.url_of(self.rel), e)
