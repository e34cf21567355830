"""One write attempt: the one place where anything shardckpt writes is guarded, leased, written
by every process of a :class:`~shardckpt.checkpoint.job.Job`, agreed, committed and, on failure,
discarded. Reshard, the imports, ``synth``, the training save, the node tier's durable copy, the
DCP storage writer and the exports are all attempts.

Call order (every process of the job, the same steps in the same order; :meth:`Attempt.run`
does them all):

1. :meth:`~Attempt.open` (one agreement): rank 0 runs ``guard`` (the checks on the destination:
   an existing checkpoint, ``--overwrite``; its result is :attr:`~Attempt.guarded` there, and on
   every process with ``tell_guard``), opens its writer under a new save id (or the one given),
   checks the room for it (``room``), and takes the attempt's lease, held until the outcome is
   known (``shardckpt clean`` leaves a leased attempt alone); every other process opens a writer
   of rank 0's save id. From here on a failure discards what the attempt wrote.
2. :meth:`~Attempt.write` (one agreement): each process writes its share and reports it (JSON);
   every process learns every report, in rank order.
   Then ``check_written(writer, reports)`` on every process, where given: a check of what was
   written that every process takes part in (it may run its own agreements: HSDP's replica
   check); its error fails the attempt like a write's.
3. :meth:`~Attempt.commit` (one agreement): on rank 0, ``verify_before_commit(writer, reports)``
   (a last check of what every process wrote: the place for a check that must pass before
   anything is committed; its error fails the attempt like a write's), then ``commit(writer,
   reports)``; its result is :attr:`~Attempt.committed` there.
4. On a failure before the commit, on rank 0: the lease released, :meth:`~Attempt.fail`
   discards the attempt's files (unless ``discard`` is off: the training save leaves them to
   resume and ``clean``), and the error is raised; where the commit happened but telling every
   process failed (a process is gone), rank 0 logs it and the checkpoint stands (a
   :attr:`~shardckpt.checkpoint.job.Job.collective` job raises there too, and its caller points
   ``latest`` at what committed).

A failure anywhere fails every process alike (:meth:`Job.gather`). An attempt whose steps are
driven by someone else (DCP's ``StorageWriter`` callbacks) calls :meth:`~Attempt.open`,
:meth:`~Attempt.commit`, :meth:`~Attempt.release` and :meth:`~Attempt.fail` itself, in that order.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar
from collections.abc import Callable, Sequence

from shardckpt.checkpoint.job import Job
from shardckpt.errors import ShardckptError
from shardckpt.storage import DEFAULT_TTL_S, Storage

log = logging.getLogger(__name__)


class Writes(Protocol):
    """What an attempt writes through: a :class:`~shardckpt.checkpoint.writer.CheckpointWriter`,
    or the :class:`ForeignFiles` of an export."""

    @property
    def save_id(self) -> str: ...

    def lease(self, ttl_s: float = DEFAULT_TTL_S, hold: bool = True) -> AbstractContextManager[Any]: ...

    def discard(self) -> bool: ...


W = TypeVar("W", bound=Writes)
R = TypeVar("R")


@dataclass(frozen=True)
class Steps:
    """The names of an attempt's three agreements, as its errors name them."""

    open: str
    write: str
    commit: str

    @classmethod
    def named(cls, what: str) -> Steps:
        return cls(f"{what}: preparing the destination", f"{what}: writing the files",
                   f"{what}: committing")


class Attempt(Generic[W]):
    """One write attempt of ``job`` at ``where`` (a URL, for messages). See the module docstring
    for the call order. ``open_writer(save_id)`` opens a writer (``None``: under a new save id).

    ``save_id``: the attempt's (None: rank 0 picks one). ``guard()``: rank 0's checks before
    anything is written. ``room(writer)``: rank 0's check of the space. ``after_loss(committing,
    writer)``: what a lost process left behind (asked then; ``writer``: this process's, or None
    if not open yet). ``verify_before_commit(writer, reports)``: see step 3.
    """

    def __init__(self, job: Job, where: str, steps: Steps, open_writer: Callable[[str | None], W], *,
                 save_id: str | None = None, guard: Callable[[], Any] | None = None,
                 tell_guard: bool = False, room: Callable[[W], None] | None = None,
                 discard: bool = True, lease_ttl_s: float = DEFAULT_TTL_S,
                 after_loss: Callable[[bool, W | None], str] | None = None,
                 verify_before_commit: Callable[[W, list[Any]], None] | None = None,
                 check_written: Callable[[W, list[Any]], None] | None = None) -> None:
        self.job, self.where, self.steps, self.open_writer = job, where, steps, open_writer
        self.save_id, self.guard, self.tell_guard, self.room = save_id, guard, tell_guard, room
        self.discard, self.lease_ttl_s, self.after_loss = discard, lease_ttl_s, after_loss
        self.verify_before_commit, self.check_written = verify_before_commit, check_written
        self.writer: W | None = None      # this process's, once open
        self.guarded: Any = None          # guard()'s result: rank 0's (every process's with tell_guard)
        self.committed: Any = None        # commit()'s result, on rank 0 once committed
        self.reports: list[Any] = []      # every process's write report, in rank order
        self._held = ExitStack()          # rank 0's lease
        self._opened: W | None = None     # rank 0's writer, from the moment a failure discards it

    # --------------------------------------------------------------------------- the steps

    def open(self) -> W:
        """Step 1: guard, writer, room and lease on rank 0; every process's writer."""
        def prepare() -> dict[str, Any]:
            self.guarded = self.guard() if self.guard is not None else None
            w = self.open_writer(self.save_id)
            if self.room is not None:
                self.room(w)
            self._opened = w
            self._held.enter_context(w.lease(self.lease_ttl_s))
            self.writer = w
            return {"save_id": w.save_id, "guard": self.guarded if self.tell_guard else None}

        _, said = self.job.gather(prepare, lambda doc: doc, self.steps.open, root_only=True,
                                  after_loss=self._lost(False))
        if self.writer is None:
            self.writer = self.open_writer(said[0]["save_id"])
            if self.tell_guard:
                self.guarded = said[0]["guard"]
        return self.writer

    def write(self, share: Callable[[W], Any]) -> list[Any]:
        """Step 2: ``share(writer)`` here (its JSON report); every process's report, in rank order."""
        w = self._writer()
        _, self.reports = self.job.gather(lambda: share(w), lambda r: r, self.steps.write,
                                          after_loss=self._lost(False))
        return self.reports

    def commit(self, commit: Callable[[W, list[Any]], R], reports: Sequence[Any] | None = None) -> R | None:
        """Step 3: on rank 0, ``verify_before_commit`` then ``commit(writer, reports)`` (the
        reports of step 2 where None); its result there, None elsewhere."""
        w, done = self._writer(), list(self.reports if reports is None else reports)

        def run() -> None:
            if self.verify_before_commit is not None:
                self.verify_before_commit(w, done)
            self.committed = commit(w, done)

        self.job.gather(run, lambda _: None, self.steps.commit, root_only=True,
                        after_loss=self._lost(True))
        return self.committed

    def release(self) -> None:
        """Release rank 0's lease (the outcome is known, or another party will not go on)."""
        self._held.close()

    def fail(self, error: BaseException) -> None:
        """After ``error``: release the lease; unless committed, discard the attempt's files
        (rank 0; where that fails, the error says how to remove them) and raise ``error``; where
        committed, log it (a collective job raises)."""
        self.release()
        if self.committed is None or self.job.collective:
            w, self._opened = self._opened, None
            if self.committed is None and w is not None and self.discard:
                if not w.discard() and isinstance(error, ShardckptError):
                    said = error.args[0] if error.args else type(error).__name__
                    error.args = (f"{said}; `shardckpt clean {self.where}` removes the unfinished "
                                  f"{w.save_id}/",)
            raise error
        log.warning("%s: committed save %s, but could not tell every process (%s)", self.where,
                    self._writer().save_id, error)

    # ----------------------------------------------------------------------------- the whole

    def run(self, share: Callable[[W], Any], commit: Callable[[W, list[Any]], R]) -> R | None:
        """Steps 1 to 4: open, write ``share``, commit; on failure :meth:`fail`. Returns
        ``commit``'s result on rank 0 (None elsewhere); the reports are :attr:`reports`."""
        try:
            with self._held:  # the lease, released before a failed attempt is discarded
                self.open()
                self.write(share)
                if self.check_written is not None:
                    self.check_written(self._writer(), self.reports)
                self.commit(commit)
        except BaseException as e:  # noqa: BLE001 - fail() raises it unless committed
            self.fail(e)
        return self.committed

    def _writer(self) -> W:
        if self.writer is None:
            raise ShardckptError(f"{self.where}: the attempt was not opened")
        return self.writer

    def _lost(self, committing: bool) -> Callable[[], str] | None:
        after = self.after_loss
        return None if after is None else (lambda: after(committing, self.writer))


class ForeignFiles:
    """The files an export writes in a foreign format (no save directory, no manifest of ours):
    :meth:`create` records each; :meth:`discard` removes them one by one. No lease: nothing of
    shardckpt's removes them meanwhile."""

    save_id = ""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.written: list[str] = []

    def create(self, rel: str, data: bytes) -> None:
        """Create ``rel`` (create-only) and record it."""
        self.storage.create_only(rel, data)
        self.written.append(rel)

    def lease(self, ttl_s: float = DEFAULT_TTL_S, hold: bool = True) -> AbstractContextManager[Any]:
        return nullcontext()

    def discard(self) -> bool:
        """Remove every file recorded, best effort (what is left is logged)."""
        for rel in self.written:
            try:
                self.storage.remove_inside(rel)  # no link followed out of the destination
            except Exception as e:  # noqa: BLE001 - best effort; the missing commit is what counts
                log.warning("could not remove %s (%s)", self.storage.url_of(rel), e)
        return True
