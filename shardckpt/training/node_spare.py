"""A rank's spare shard file on its node (``LocalTier.preallocate``, :mod:`shardckpt.storage.spare`):
the first is made in a background thread once the run is training (at a ``save()`` call that
saves nothing: sized from the engine's shards, so that the first local save of a process writes
over allocated pages too; never while a resume reads or a save writes), each
next one after a save (the size of the shard file just written, unless a spare as large is
ready), within the tier's quota."""

from __future__ import annotations

import threading
from typing import Any

from shardckpt.checkpoint.tiers import HEADER_ALLOWANCE, SPARE_NAME, LocalTier, used_bytes
from shardckpt.storage import Spare, Storage


def shard_bytes(engine: Any) -> int:
    """About the bytes of ``engine``'s shard file on this rank (0 where a shard is not in
    memory: an offloaded one is streamed, and takes no spare)."""
    n = 0
    for kinds in engine.local_shards().values():
        for t in kinds.values():
            if hasattr(t, "iter_bytes") or not hasattr(t, "element_size"):
                return 0
            n += t.numel() * t.element_size()
    return n + HEADER_ALLOWANCE if n else 0


class NodeSpare:
    """This rank's :class:`~shardckpt.storage.Spare` in its node's directory ``storage``."""

    def __init__(self, tier: LocalTier, storage: Storage, rank: int, engine: Any) -> None:
        self.tier, self.storage = tier, storage
        self.spare = Spare(storage, SPARE_NAME.format(rank=rank))
        self.spare.discard()  # one an earlier process of this rank left
        self.engine, self.rank = engine, rank
        self.first: threading.Thread | None = None
        self.started = False

    def start(self) -> None:
        """Make the first spare in a background thread (once; nothing where the engine's
        shards are not in memory)."""
        if self.started:
            return
        self.started = True
        n = shard_bytes(self.engine)
        if n:
            self.first = threading.Thread(target=self._prepare, args=(n,), daemon=True,
                                          name=f"shardckpt-spare-{self.rank}")
            self.first.start()

    @property
    def nbytes(self) -> int:
        """The size of the spare ready to be taken (0: none)."""
        return self.spare.nbytes

    def _prepare(self, n: int) -> None:
        q = self.tier.quota_bytes
        if q is None or used_bytes(self.storage) + n <= q:
            self.spare.prepare(n)

    def settle(self) -> None:
        """Wait until the first spare's thread, if one was started, is done."""
        if self.first is not None:
            self.first.join()
            self.first = None

    def after_save(self, n: int) -> None:
        """Allocate the next spare: ``n`` bytes, the size of the shard file just written."""
        self.settle()
        self.started = True
        if n and self.spare.nbytes < n:  # one as large (the first, made from the shards) is cut at use
            self._prepare(n)

    def drop_unused(self) -> None:
        """Remove a spare a save did not take (an offloaded shard streams instead): its room back."""
        if self.spare.nbytes:
            self.spare.discard()

    def close(self) -> None:
        """Give the spare back (the first one's thread done first: none is made after this)."""
        self.settle()
        self.spare.discard()
