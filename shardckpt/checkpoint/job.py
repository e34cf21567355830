"""A job: the processes that share one piece of work, and one process alone as a job of one.

The offline tools (reshard, consolidate, verify, diff) and the imports each have one flow, written
against :class:`Job`: every process opens its inputs, takes its share of the output
(:meth:`Job.share`), reports what it did (:meth:`Job.agree`), and rank 0 commits
(:meth:`Job.on_root`). One process is a job of one (:meth:`Job.single`): its collectives are
plain calls, so a local command runs the same flow without torch and without a process group,
and raises the errors the work raises, as they are.

In a job of several processes (``torchrun``), outcomes travel as JSON over
:mod:`shardckpt.checkpoint.collective` (raw bytes, no pickling); a failure on any process is raised
on every process, with the class and message of the lowest failing rank's error.

A running training job is a job too (:meth:`Job.of_group`): its process group, and optionally a
:class:`~shardckpt.checkpoint.loss_flag.LossFlag` that every agreement watches, so that a rank
lost on the way fails every survivor at once. Its agreements raise what the exchange raised (a
:class:`~shardckpt.errors.CollectiveError` naming every failing rank), even in a job of one: the
contract the training save has always had. Write attempts over a job:
:mod:`shardckpt.checkpoint.attempt`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from collections.abc import Callable, Mapping, Sequence

from shardckpt.errors import CollectiveError, ShardckptError

if TYPE_CHECKING:
    from shardckpt.checkpoint.loss_flag import LossFlag
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.storage import Storage

T = TypeVar("T")


def balance(costs: Sequence[int], k: int) -> list[list[int]]:
    """Split items ``0..len(costs)-1`` into ``k`` lists of about equal total cost: the largest
    item first, each to the least loaded list (ties: the lower index); each list sorted. Pure."""
    loads = [(0, 0, w) for w in range(k)]  # (load, items, list index), a heap
    heapq.heapify(loads)
    out: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, n, w = heapq.heappop(loads)
        out[w].append(i)
        heapq.heappush(loads, (load + costs[i], n + 1, w))
    return [sorted(x) for x in out]


@dataclass(frozen=True)
class Job:
    """This process's place in the job. Every process calls the same methods in the same order.

    ``Job(0, 1)`` (:meth:`single`) is one process alone: nothing is exchanged, ``fn`` results
    are not serialized, and errors propagate unchanged. Torch is imported only by a job of
    several processes.
    """

    rank: int
    world_size: int
    group: Any = None
    #: where set, every agreement is watched for a lost rank (:mod:`.loss_flag`)
    flag: LossFlag | None = None
    #: errors as the exchange raises them (a CollectiveError), in a job of one too
    collective: bool = False

    @classmethod
    def single(cls) -> Job:
        """One process alone: a job of one, whose collectives are plain calls."""
        return cls(0, 1)

    @classmethod
    def of_group(cls, group: Any = None, flag: LossFlag | None = None) -> Job:
        """The processes of ``group`` (the default group where None; a process alone without
        torch.distributed) in a running training job: its agreements raise
        :class:`~shardckpt.errors.CollectiveError`, watched through ``flag`` where given."""
        from shardckpt.checkpoint.collective import rank_and_world

        rank, world = rank_and_world(group)
        return cls(rank, world, group, flag, collective=True)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def gather(self, fn: Callable[[], T], tell: Callable[[Any], Any], what: str,
               root_only: bool = False,
               after_loss: Callable[[], str] | None = None) -> tuple[T | None, list[Any]]:
        """Run ``fn`` here (on rank 0 only with ``root_only``; None elsewhere) and keep its
        result; every process learns each process's ``tell(result)`` (JSON), in rank order. If
        ``fn`` failed anywhere, every process raises the lowest failing rank's error (with
        :attr:`collective`, the exchange's :class:`CollectiveError`; ``after_loss()`` says
        what a lost rank left behind)."""
        here: list[T] = []

        def run() -> Any:
            if root_only and not self.is_root:
                return None
            result = fn()
            here.append(result)
            return tell(result)

        if self.world_size == 1 and not self.collective:
            told = run()
            return here[0], [told]
        from shardckpt.checkpoint.collective import agree, same_error

        try:
            _, reports = agree(run, what, self.group, after_loss, self.flag)
        except CollectiveError as e:
            if self.collective:
                raise
            raise same_error(e, what) from e
        return (here[0] if here else None), [r["payload"] for r in reports]

    def agree(self, fn: Callable[[], Any], what: str) -> list[Any]:
        """Run ``fn`` here (its result JSON), then every process's result, in rank order; if ``fn``
        failed anywhere, every process raises the lowest failing rank's error (same class)."""
        return self.gather(fn, lambda r: r, what)[1]

    def on_root(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on rank 0 only; its JSON result (or its error) on every process."""
        return self.gather(fn, lambda r: r, what, root_only=True)[1][0]

    def open(self, fn: Callable[[], T], save_ids: Callable[[Any], Any], where: str, what: str) -> T:
        """``fn()`` on every process: it opens what the work reads (each process reads the
        manifests once) and ``save_ids`` names what it read. Every process must have read the
        same: where a checkpoint was replaced while they opened it, every process raises."""
        opened, seen = self.gather(fn, save_ids, what)
        if len({repr(s) for s in seen}) != 1:
            saves = ", ".join(sorted({repr(s) for s in seen}))
            raise ShardckptError(f"{where}: the checkpoint changed while the job's processes "
                                 f"opened it (they read saves {saves}); run again")
        assert opened is not None
        return opened

    def barrier(self, what: str) -> None:
        """Wait until every process is here (a failure anywhere fails every process)."""
        self.agree(lambda: None, what)

    def share(self, costs: Sequence[int]) -> list[int]:
        """The items (indices into ``costs``) this process takes: :func:`balance`'s split."""
        return balance(costs, self.world_size)[self.rank]


def open_readers(job: Job, locations: Sequence[str | Storage],
                 storage_options: Mapping[str, Any] | None, what: str) -> list[CheckpointReader]:
    """A :class:`~shardckpt.checkpoint.reader.CheckpointReader` of each location (its manifest
    read once here), opened by every process of ``job``; they must have read the same manifests
    (:meth:`Job.open`), and an error opening any fails every process alike."""
    from shardckpt.checkpoint.reader import CheckpointReader

    return job.open(lambda: [CheckpointReader(loc, storage_options) for loc in locations],
                    lambda rs: [r.manifest.save_id for r in rs],
                    ", ".join(loc if isinstance(loc, str) else loc.url for loc in locations), what)
