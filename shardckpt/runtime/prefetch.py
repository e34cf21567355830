"""Prefetching of the units' all-gathers: overlap the next unit's gather with this unit's compute.

Without prefetch, a unit is all-gathered when it is about to run and the compute waits for it. With
prefetch (PyTorch FSDP's forward and backward prefetch), the all-gather of the unit that runs
*next* is issued asynchronously while the current unit computes:

* **forward**: when unit ``X`` starts its forward, the unit that followed ``X`` in the previous
  forward pass (the order is recorded per pass; the first pass has none to follow, so it does not
  prefetch) starts gathering;
* **backward** (reverse order): when the gradient of ``X``'s output arrives, the unit whose
  forward finished just before ``X``'s in this step's forward (the next to run backward) starts
  gathering.

On CUDA the cast of the master shard to the compute dtype and the all-gather are issued on a side
stream (:class:`CommStream`), so they do not queue behind the compute kernels; the compute stream
waits for the side stream only when it needs the unit. On CPU (gloo) the backend runs an
asynchronous collective on its own threads.

Invariants: prefetch changes when collectives are issued, never which ones or their bytes, so the
results are bit for bit those of a run without it; every rank must run the same units in the same
order (as without prefetch), so the prefetches pair up too. A prefetched unit whose turn does not
come (the order changed) stays gathered until its own forward or backward or the end of the
backward pass, and is then freed like any other. Nothing waits on a collective that was never
issued, and a buffer a collective still writes is never freed (:meth:`InFlight.wait` first).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol
from collections.abc import Iterator, Sequence

import torch


class Gatherable(Protocol):
    """What the prefetcher needs of a unit (:class:`shardckpt.runtime.stages.Unit`)."""

    @property
    def gathered(self) -> bool: ...

    def start_gather(self) -> None: ...


@dataclass
class InFlight:
    """One asynchronous all-gather: the backend's work handle, the tensors it reads (kept alive
    until it is done) and, on CUDA, the side stream it was issued on."""

    work: Any
    keep: tuple[torch.Tensor, ...]
    stream: Any = None

    def wait(self) -> None:
        """Block until the collective is done; on CUDA make the current stream wait for it."""
        if self.work is not None:
            self.work.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.work, self.keep = None, ()


class CommStream:
    """A side stream for communication on CUDA; on other devices a no-op.

    :meth:`issue` runs its block on the side stream after the side stream has waited for the
    current (compute) stream, so the collective reads the masters as the optimizer left them and
    writes a buffer the compute stream allocated.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def issue(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield


class Prefetcher:
    """Decides which unit to gather ahead (see the module docstring) and starts its all-gather.

    Called by :class:`~shardckpt.runtime.stages.StageSchedule` from its hooks, never inside an
    activation recomputation. ``enabled=False`` records nothing and prefetches nothing.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._last_order: list[Any] = []     # pre-forward order of the previous forward pass
        self._order: list[Any] = []          # ... of the current one
        self._cursor = 0                     # where the current pass is in _last_order
        self._post_order: list[Any] = []     # post-forward order (grad-enabled) of this pass
        self._bwd_cursor = 0
        self._bwd_seen: set[int] = set()
        self.prefetches = 0                  # gathers started ahead (for tests and logs)

    def begin_forward(self) -> None:
        """A top-level forward starts: the pass recorded so far becomes the order to follow."""
        if self._order:
            self._last_order, self._order = self._order, []
        self._cursor = 0
        self._post_order = []

    def pre_forward(self, unit: Gatherable) -> None:
        """``unit`` is gathered and about to run: start the unit that followed it last time."""
        if not self.enabled:
            return
        self._order.append(unit)
        order = self._last_order
        for j in range(self._cursor, len(order)):
            if order[j] is unit:
                self._cursor = j + 1
                if j + 1 < len(order):
                    self._start(order[j + 1])
                return

    def post_forward(self, unit: Gatherable) -> None:
        """``unit``'s forward finished and its backward will come: record it for backward."""
        if self.enabled:
            self._post_order.append(unit)
            self._bwd_cursor = len(self._post_order)

    def pre_backward(self, unit: Gatherable) -> None:
        """``unit`` is gathered for its backward: start the unit whose backward comes next."""
        if not self.enabled or id(unit) in self._bwd_seen:
            return
        self._bwd_seen.add(id(unit))
        order = self._post_order
        for j in range(min(self._bwd_cursor, len(order)) - 1, -1, -1):
            if order[j] is unit:
                self._bwd_cursor = j
                target = _previous_other(order, j)
                if target is not None:
                    self._start(target)
                return

    def end_backward(self) -> None:
        self._bwd_seen.clear()
        self._bwd_cursor = len(self._post_order)

    def _start(self, unit: Gatherable) -> None:
        if not unit.gathered:
            unit.start_gather()
            self.prefetches += 1


def _previous_other(order: Sequence[Any], j: int) -> Any:
    """The last unit before position ``j`` that is not ``order[j]`` itself."""
    for k in range(j - 1, -1, -1):
        if order[k] is not order[j]:
            return order[k]
    return None
