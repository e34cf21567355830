"""A sliding window of ranged reads for the streams of object stores (consolidate's pieces).

Read batch by batch (:meth:`~shardckpt.storage.reads.RangeReader.read_many`, one batch read
ahead), a stream waits at the end of every batch for that batch's slowest GET, and the batch
after it starts only then: with many small GETs (a 64-rank checkpoint's 0.56 MB slots) most of
the threads are idle most of the time. :func:`windowed_reads` reads the same chains
(:meth:`~shardckpt.storage.reads.RangeReader.chains`) on one pool of ``workers`` threads kept
busy across batches: the chains of later batches are queued as soon as their bytes fit in
``budget``, so a thread that ends a read takes the next one, whatever batch it belongs to.

Invariants:

* results come back batch by batch, in order, each request's bytes those of its file, checked;
* the requested bytes of the batches queued, being read, read or in the caller's hands are at
  most ``budget``, but the batch after the one the caller has is always queued (as a plain
  read-ahead holds it): two batches larger than the budget together still go;
* each byte is fetched about once: a chain that shares a checksum chunk with the latest chain
  of the same file (the end of one batch and the start of the next) waits for it on its thread,
  and takes the shared chunk from the reader's boundary cache;
* a read that fails (a thread that dies) fails the stream when its batch is reached: an error,
  never a hang. Closing the stream cancels the queued reads and waits for the running ones.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from collections.abc import Iterable, Iterator, Sequence

from shardckpt.storage.reads import REMOTE_READS_IN_FLIGHT, Chain, RangeReader, Request, read_ahead

TagT = TypeVar("TagT")
Data = bytes | memoryview


@dataclass
class _Batch(Generic[TagT]):
    tag: TagT
    requests: Sequence[Request]
    nbytes: int
    out: list[Data]
    futures: list[Future[None]] = field(default_factory=list)


def _requested(requests: Sequence[Request]) -> int:
    return sum(b - a for _, a, b in requests)


def windowed_reads(ranges: RangeReader, jobs: Iterable[tuple[TagT, Sequence[Request]]],
                   budget: int, workers: int | None = None) -> Iterator[tuple[TagT, list[Data]]]:
    """``(tag, bytes of each request)`` for each ``(tag, requests)`` of ``jobs``, in order, read
    through a sliding window (module doc) of at most ``budget`` requested bytes on ``workers``
    threads (:data:`~shardckpt.storage.reads.REMOTE_READS_IN_FLIGHT` unless given). Where the
    storage maps files: each batch mapped, one read ahead. Close the iterator (or exhaust it) to
    end the threads."""
    if ranges.maps:
        for (tag, _), got in read_ahead(jobs, lambda job: ranges.map_many(job[1])):
            yield tag, got  # type: ignore[misc]
        return
    window = _Window(ranges, REMOTE_READS_IN_FLIGHT if workers is None else max(1, workers))
    try:
        yield from window.run(iter(jobs), budget)
    finally:
        window.close()


class _Window:
    """The state of one :func:`windowed_reads` stream."""

    def __init__(self, ranges: RangeReader, workers: int) -> None:
        self.ranges = ranges
        self.cs = ranges.chunk_size
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="shardckpt-window")
        self.latest: dict[str, tuple[int, Future[None]]] = {}  # file: its latest chain's last chunk

    def run(self, jobs: Iterator[tuple[Any, Sequence[Request]]], budget: int) -> Iterator[tuple[Any, list[Data]]]:
        queued: deque[_Batch[Any]] = deque()
        held = 0  # requested bytes of the queued batches and of the one in the caller's hands
        following: _Batch[Any] | None = None  # the next batch, waiting for room in the budget
        while True:
            while True:
                if following is None:
                    job = next(jobs, None)
                    if job is None:
                        break
                    tag, requests = job
                    following = _Batch(tag, requests, _requested(requests), [b""] * len(requests))
                if len(queued) >= 2 and held + following.nbytes > budget:
                    break  # the next batch and one more are queued, as a read-ahead would
                self._submit(following)
                held += following.nbytes
                queued.append(following)
                following = None
            if not queued:
                return
            batch = queued.popleft()
            for f in batch.futures:
                f.result()  # a read's error, raised here in the caller's thread
            yield batch.tag, batch.out
            held -= batch.nbytes  # the caller is done with it
            del batch

    def _submit(self, batch: _Batch[Any]) -> None:
        for chain in self.ranges.chains(batch.requests):
            entry, lo, _, _ = chain[0]
            hi = chain[-1][2]
            prior = self.latest.get(entry.path)
            after = prior[1] if prior is not None and prior[0] >= lo // self.cs else None
            fut = self.pool.submit(self._read, batch, chain, after)
            self.latest[entry.path] = ((hi - 1) // self.cs, fut)
            batch.futures.append(fut)

    def _read(self, batch: _Batch[Any], chain: Chain, after: Future[None] | None) -> None:
        if after is not None:
            # the chain before shares a chunk with this one: once it is read, the chunk is in
            # the boundary cache. It was queued first, so it runs (or ran) already: no deadlock.
            after.result()
        self.ranges.read_chain(batch.requests, chain, batch.out)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.latest.clear()
