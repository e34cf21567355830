"""Host copies of the shards for async saves, allocated off the training thread.

An async save copies the live shards aside (``SaveJob.stage``) so that training may go on while
the files are written. Those copies are page-locked host memory where CUDA exists (the copy
then runs at the device-to-host rate), allocated once and kept. Allocating gigabytes of pinned
memory takes seconds; done inside the first ``save()`` it stalled training for that long. Here it
starts in a background thread when the :class:`~shardckpt.training.checkpointer.Checkpointer`
is built; a save that comes before it is done does not wait for it either: its background
thread waits, then stages (the next optimizer update waits for the staging, as for every async
save).

``max_bytes`` bounds it for hosts short of memory: a state larger than that gets no staging at
all, and an async save then writes from the live shards through the bounded ring of the
parallel write (:mod:`shardckpt.storage.pwrite`); the next update waits until the files are
written, so training pauses for about the write of the state instead of its device-to-host copy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

Shape = dict[str, dict[str, tuple[Any, Any]]]


def _shape(live: Mapping[str, Mapping[str, Any]], on_disk: set[str]) -> Shape:
    return {g: {k: (tuple(t.shape), t.dtype) for k, t in kinds.items()}
            for g, kinds in live.items() if g not in on_disk}


def _nbytes(shape: Shape) -> int:
    import math

    return sum(math.prod(s) * _itemsize(d) for kinds in shape.values() for s, d in kinds.values())


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


class Staging:
    """The staging buffers of one Checkpointer (see the module docstring)."""

    def __init__(self, live: Mapping[str, Mapping[str, Any]], max_bytes: int | None = None) -> None:
        import torch

        self.max_bytes, self.pin = max_bytes, torch.cuda.is_available()
        self.lock = threading.Lock()
        self.buffers: dict[str, dict[str, Any]] | None = None
        self.shape: Shape = {}
        self.bytes = 0
        self.error: BaseException | None = None
        self.ready = threading.Event()
        # groups kept in offload files are snapshot on their disk instead (nvme offload)
        want = _shape(live, {g for g, kinds in live.items()
                             if any(hasattr(t, "iter_bytes") for t in kinds.values())})
        self.off = max_bytes is not None and _nbytes(want) > max_bytes
        if self.off:
            log.info("async save: no staging (the state's %d bytes exceed max_staging_bytes=%d); "
                     "the next update after a save waits until its files are written",
                     _nbytes(want), max_bytes)
            self.ready.set()
            return
        threading.Thread(target=self._allocate, args=(want,), name="shardckpt-staging",
                         daemon=True).start()

    def _allocate(self, shape: Shape) -> None:
        import torch

        try:
            bufs = {g: {k: torch.empty(s, dtype=d, device="cpu", pin_memory=self.pin)
                        for k, (s, d) in kinds.items()} for g, kinds in shape.items()}
            with self.lock:
                self.buffers, self.shape, self.bytes = bufs, shape, _nbytes(shape)
            log.info("async save: %d bytes of %s host memory for staging", self.bytes,
                     "pinned" if self.pin else "pageable")
        except BaseException as e:  # noqa: BLE001 - raised by the save that needs it
            self.error = e
        finally:
            self.ready.set()

    def get(self, live: Mapping[str, Mapping[str, Any]], on_disk: set[str],
            wait: bool) -> dict[str, dict[str, Any]] | None:
        """Buffers shaped like ``live`` (``None`` for every kind of the groups in ``on_disk``),
        or None: staging is off, or (``wait`` false) not allocated yet. Waits for (and redoes,
        where an optimizer's state kinds came since) the allocation when ``wait``."""
        if self.off:
            return None
        if not self.ready.is_set() and not wait:
            return None
        self.ready.wait()
        if self.error is not None:
            raise self.error
        need = _shape(live, on_disk)
        if any(self.shape.get(g) != kinds for g, kinds in need.items()):
            if not wait:
                return None
            self.ready.clear()
            self._allocate({**self.shape, **need})
            if self.error is not None:
                raise self.error
        assert self.buffers is not None
        return {g: (self.buffers[g] if g in need else dict.fromkeys(kinds))
                for g, kinds in live.items()}
