"""The one place a :class:`~shardckpt.training.checkpointer.Checkpointer` runs a tier's save:
in the caller's thread, or in a background thread with at most one save in flight.

A tier's ``save`` returns a :class:`Pending`; :meth:`SaveExecutor.run` runs it. ``staged`` is
what the optimizer's next step waits for: cleared while a pending save that stages (copies the
shards aside in the background) has not done so, set otherwise.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from collections.abc import Callable

from shardckpt.format.manifest import Manifest


@dataclass(frozen=True)
class Pending:
    """What is left of a save once a tier's ``save`` returns: ``work(staged)`` (which sets
    ``staged`` once the shards may change again, where ``stages``), run ``background`` or in
    the caller's thread; ``name`` names its thread."""

    work: Callable[[threading.Event], Manifest | None]  # None: nothing was saved after all
    name: str
    background: bool = True
    stages: bool = False


class SaveExecutor:
    """Runs pending saves; the next :meth:`run` or :meth:`wait` raises the error of the last."""

    def __init__(self) -> None:
        self.staged = threading.Event()
        self.staged.set()
        self._pending: Future[Manifest | None] | None = None
        self._thread: threading.Thread | None = None

    def run(self, pending: Pending) -> None:
        """Run ``pending`` (after waiting for the save in flight, raising its error)."""
        self.wait()
        if not pending.background:
            pending.work(self.staged)
            return
        fut: Future[Manifest | None] = Future()
        if pending.stages:
            self.staged.clear()

        def run() -> None:
            try:
                fut.set_result(pending.work(self.staged))
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                fut.set_exception(e)
            finally:
                self.staged.set()

        thread = threading.Thread(target=run, name=pending.name, daemon=True)
        thread.start()
        self._pending, self._thread = fut, thread

    def wait(self) -> Manifest | None:
        """Wait for the save in flight, if any; raise its error."""
        fut, self._pending = self._pending, None
        if fut is None:
            return None
        try:
            return fut.result()
        finally:
            if self._thread is not None:
                self._thread.join()  # the thread owns collectives until it has fully ended
                self._thread = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()
