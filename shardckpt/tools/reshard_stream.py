"""The bytes of reshard's target files: the plan's copies cut into read batches, read ahead
with checked ranged reads, and streamed into the writer slot by slot.

Memory is bounded by two batches of at most ``buffer_bytes`` (plus a few cached boundary chunks),
not by the checkpoint. A batch holds pieces of the target files' slots: zero bytes (padding),
source byte ranges, or (chunked tensors split along other dims than the first) a function that
assembles a box. Does not import torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.writer import CheckpointWriter, Producer
from shardckpt.errors import ShardckptError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import FileEntry, TensorSlot
from shardckpt.format.reshard_plan import Copy, ReshardPlan
from shardckpt.storage import RangeReader, read_ahead, Request
from shardckpt.tools.reshard_overlap import write_overlapped

#: A piece of a slot's bytes: that many zero bytes, a checked source range, or a function that
#: returns the bytes (called on the read-ahead thread).
Piece = int | Request | Callable[[], Any]
#: The pieces of one target file's slots in file order: (slot index, piece) pairs.
Batch = list[tuple[int, Piece]]


class Batcher:
    """Cuts the pieces of target files into batches of at most ``buffer_bytes`` (at least one
    piece each) that run across slot boundaries, so that small slots share a batch and adjacent
    ranges of one source file coalesce into one read. :attr:`batches` holds (file, batch) pairs."""

    def __init__(self, buffer_bytes: int) -> None:
        self.buffer_bytes = buffer_bytes
        self.batches: list[tuple[int, Batch]] = []
        self.size = 0

    def add(self, file: int, slot: int, piece: Piece, nbytes: int) -> None:
        """Append ``piece`` (``nbytes`` held in memory) of ``slot`` of target ``file``."""
        if (not self.batches or self.batches[-1][0] != file
                or (self.size + nbytes > self.buffer_bytes and self.batches[-1][1])):
            self.batches.append((file, []))
            self.size = 0
        self.batches[-1][1].append((slot, piece))
        self.size += nbytes


@dataclass(frozen=True)
class Written:
    """What one process (or worker) wrote: the entries of its files and the source bytes read."""

    entries: tuple[FileEntry, ...]
    bytes_read: int

    def to_doc(self) -> dict[str, Any]:
        return {"read": self.bytes_read, "entries": [e.to_doc() for e in self.entries]}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Written:
        return cls(tuple(FileEntry.from_doc(e) for e in doc["entries"]), doc["read"])

    @classmethod
    def join(cls, parts: Sequence[Written]) -> Written:
        return cls(tuple(e for p in parts for e in p.entries), sum(p.bytes_read for p in parts))


def plan_batches(reader: CheckpointReader, plans: Mapping[str, ReshardPlan], shard: int,
                 slots: Sequence[TensorSlot], batcher: Batcher) -> None:
    """Add the pieces of every slot of target shard ``shard``, in file order, to ``batcher``: an
    int (that many zero bytes) or a source range to read."""
    by_group: dict[str, list[Copy]] = {}
    for plan in plans.values():
        for c in plan.for_dst_shard(shard):
            by_group.setdefault(c.dst_group, []).append(c)
    max_batch = batcher.buffer_bytes
    for si, slot in enumerate(slots):
        group, kind = slot.name.rsplit(".", 1)
        n = itemsize(slot.dtype)
        max_elems = max(1, max_batch // n)
        pos = 0
        for c in by_group.get(group, ()):
            if c.dst_offset > pos:
                batcher.add(shard, si, (c.dst_offset - pos) * n, 0)
            for x in range(0, c.numel, max_elems):
                take = min(c.numel - x, max_elems)
                batcher.add(shard, si, reader.state_range(c.src_shard, c.src_group, kind,
                                                          c.src_offset + x, c.src_offset + x + take),
                            take * n)
            pos = c.dst_offset + c.numel
        if pos < slot.shape[0]:
            batcher.add(shard, si, (slot.shape[0] - pos) * n, 0)


class ShardStream:
    """The bytes of target files, slot by slot: :meth:`for_shard` gives the slot producer of a
    file; the files' bytes come in the order of ``batches`` (from a :class:`Batcher`).

    The batches are read through one :func:`~shardckpt.storage.read_ahead` loop: the next batch
    is read while the current one is written, so at most two batches are held at once; within a
    batch, source files are read concurrently (``read_workers``). The read-ahead runs across
    files: the first batch of the next file is read while the last one of this file is written.
    Where the storage maps files (local), a range is not copied: it is a view of the mapped source
    file, its chunks CRC-checked once, written straight from the page cache; a batch's mappings
    go when the batch has been written.

    Producers of several files may run on several threads (:func:`stream_files`): a file's
    producer takes its batches only once every batch of the files before it has been taken, so
    the file after one that is completing its upload (or its fsync) streams meanwhile. After
    :meth:`fail`, a producer that waits or takes a batch raises.
    """

    def __init__(self, ranges: RangeReader, batches: Sequence[tuple[int, Batch]],
                 on_bytes: Callable[[int], None] | None, read_workers: int | None = None) -> None:
        self.ranges, self.on_bytes, self.read_workers = ranges, on_bytes, read_workers
        self.batches = [(t, b) for t, b in batches if b]
        self.zeros = bytes(max((p for _, b in self.batches for _, p in b if isinstance(p, int)),
                               default=0))
        self.first: dict[int, int] = {}  # file: the index of its first batch
        self.count: dict[int, int] = {}  # file: its number of batches
        for k, (t, _) in enumerate(self.batches):
            self.first.setdefault(t, k)
            self.count[t] = self.count.get(t, 0) + 1
        self.stream = read_ahead(self.batches, self._fetch)
        self.taken = 0  # batches taken from the stream
        self.turn = threading.Condition()
        self.failed: BaseException | None = None

    def _fetch(self, item: tuple[int, Batch]) -> list[tuple[int, Any]]:
        _, batch = item
        data = iter(self.ranges.fetch([p for _, p in batch if isinstance(p, tuple)],
                                      self.read_workers))
        zview = memoryview(self.zeros)
        return [(si, zview[:p] if isinstance(p, int) else self.ranges.sourced(p, next(data))
                 if isinstance(p, tuple) else p()) for si, p in batch]

    def fail(self, error: BaseException) -> None:
        """Stop every producer: a file's write failed (the first error is kept)."""
        with self.turn:
            if self.failed is None:
                self.failed = error
            self.turn.notify_all()

    def _check(self) -> None:
        if self.failed is not None:
            raise _Stopped("stopped: the write of another target file failed") from self.failed

    def _take(self, shard: int, j: int) -> list[tuple[int, Any]] | None:
        """Batch ``j`` of file ``shard`` once the batches before it are taken; None past its last."""
        if j >= self.count.get(shard, 0):
            return None
        k = self.first[shard] + j
        with self.turn:
            while self.taken != k:
                self._check()
                self.turn.wait()
            self._check()
        try:
            _, data = next(self.stream)  # this file's turn: no other thread takes meanwhile
        except BaseException as e:
            self.fail(e)
            raise
        with self.turn:
            self.taken += 1
            self.turn.notify_all()
        return data

    def for_shard(self, shard: int, slots: Sequence[TensorSlot]) -> Producer:
        """The producer of file ``shard``'s bytes, its ``slots`` (the batches' slot indices)."""
        index = {s.name: i for i, s in enumerate(slots)}
        current: list[tuple[int, Any]] = []  # this file's batch being written: (slot index, bytes)
        at = [0, 0]  # position in it, batches of this file taken

        def produce(slot: TensorSlot) -> Iterator[Any]:
            nonlocal current
            si = index[slot.name]
            while True:
                if at[0] == len(current):
                    current = []  # written: let it go before the next is waited for
                    got = self._take(shard, at[1])
                    if got is None:
                        return
                    current, at[0], at[1] = got, 0, at[1] + 1
                owner, piece = current[at[0]]
                if owner != si:  # the next slot's bytes: leave them for its call
                    return
                at[0] += 1
                if self.on_bytes:
                    self.on_bytes(len(piece))
                yield piece

        return produce

    def close(self) -> None:
        """End the read-ahead; once no producer runs any more."""
        self.stream.close()  # type: ignore[attr-defined]


class _Stopped(ShardckptError):
    """A producer stopped because another file's write failed (that error is the one raised)."""


def write_shards(reader: CheckpointReader, plans: Mapping[str, ReshardPlan],
                 writer: CheckpointWriter, shards: Sequence[int], buffer_bytes: int,
                 on_bytes: Callable[[int], None] | None = None) -> Written:
    """Write target shards ``shards`` (in that order) with ``writer``, their bytes read from
    ``reader`` through ``plans``."""
    batcher = Batcher(buffer_bytes)
    # every source file's header at once (on an object store a GET each: checked one by one as
    # the batches are planned, a 64-rank checkpoint's were 64 round trips in a row)
    sources = {c.src_shard for plan in plans.values() for t in shards for c in plan.for_dst_shard(t)}
    reader.check_files(reader.manifest.shard_file(s) for s in sorted(sources))
    for t in shards:
        plan_batches(reader, plans, t, writer.slots, batcher)
    return stream_files(reader, batcher.batches, shards,
                        lambda t, produce: writer.write_shard(t, produce),
                        lambda t: writer.slots, on_bytes)


def stream_files(reader: CheckpointReader, batches: Sequence[tuple[int, Batch]],
                 files: Sequence[int], write: Callable[[int, Producer], FileEntry],
                 slots_of: Callable[[int], Sequence[TensorSlot]],
                 on_bytes: Callable[[int], None] | None = None) -> Written:
    """Write each of ``files`` (``write(file, producer)``), its bytes streamed from ``batches``
    through one :class:`ShardStream`, up to :data:`FILES_IN_FLIGHT` (:mod:`.reshard_overlap`) files at once
    (:func:`~shardckpt.tools.reshard_overlap.write_overlapped`); ``slots_of(file)``: the file's
    slots."""
    ranges = RangeReader(reader.files, reader.manifest.chunk_size)
    stream = ShardStream(ranges, batches, on_bytes)
    try:
        entries = write_overlapped(stream, files, lambda t: write(t, stream.for_shard(t, slots_of(t))))
    finally:
        stream.close()
    return Written(entries, ranges.bytes_read)
