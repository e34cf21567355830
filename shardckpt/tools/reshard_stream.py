"""The bytes of reshard's target shard files: the plan's copies cut into read batches, read ahead
with checked ranged reads, and streamed into the writer slot by slot.

Memory is bounded by two batches of at most ``buffer_bytes`` (plus a few cached boundary chunks),
not by the checkpoint. Does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.writer import CheckpointWriter
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import FileEntry, TensorSlot
from shardckpt.format.reshard_plan import Copy, ReshardPlan
from shardckpt.storage import RangeReader, read_ahead


@dataclass(frozen=True)
class Written:
    """What one process (or worker) wrote: the entries of its files and the source bytes read."""

    entries: tuple[FileEntry, ...]
    bytes_read: int

    def to_doc(self) -> dict[str, Any]:
        return {"read": self.bytes_read, "entries": [e.to_doc() for e in self.entries]}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "Written":
        return cls(tuple(FileEntry.from_doc(e) for e in doc["entries"]), doc["read"])

    @classmethod
    def join(cls, parts: Sequence["Written"]) -> "Written":
        return cls(tuple(e for p in parts for e in p.entries), sum(p.bytes_read for p in parts))


def plan_batches(reader: CheckpointReader, plans: Mapping[str, ReshardPlan], shard: int,
                  slots: Sequence[TensorSlot], buffer_bytes: int) -> list[list[tuple[int, Any]]]:
    """The pieces of every slot of target ``shard``, in file order, cut into batches of at most
    ``buffer_bytes`` that run across slot boundaries (small slots share a batch, so adjacent
    ranges of one source file coalesce into one read). Each batch holds (slot index, piece)
    pairs; a piece is an int (that many zero bytes) or a source range to read."""
    by_group: dict[str, list[Copy]] = {}
    for plan in plans.values():
        for c in plan.for_dst_shard(shard):
            by_group.setdefault(c.dst_group, []).append(c)
    batches: list[list[tuple[int, Any]]] = [[]]
    batch_bytes = 0
    for si, slot in enumerate(slots):
        group, kind = slot.name.rsplit(".", 1)
        n = itemsize(slot.dtype)
        max_elems = max(1, buffer_bytes // n)
        pos = 0

        def add(piece: Any, nbytes: int) -> None:
            nonlocal batch_bytes
            if batch_bytes + nbytes > buffer_bytes and batches[-1]:
                batches.append([])
                batch_bytes = 0
            batches[-1].append((si, piece))
            batch_bytes += nbytes

        for c in by_group.get(group, ()):
            if c.dst_offset > pos:
                add((c.dst_offset - pos) * n, 0)
            for x in range(0, c.numel, max_elems):
                take = min(c.numel - x, max_elems)
                add(reader.state_range(c.src_shard, c.src_group, kind,
                                       c.src_offset + x, c.src_offset + x + take), take * n)
            pos = c.dst_offset + c.numel
        if pos < slot.shape[0]:
            add((slot.shape[0] - pos) * n, 0)
    return batches


class ShardStream:
    """The bytes of target shards ``shards``, slot by slot: :meth:`for_shard` gives the slot
    producer of a shard; the shards are written in ``shards`` order.

    The batches of every shard (:func:`plan_batches`) are read through one
    :func:`~shardckpt.storage.read_ahead` loop: the next batch is read while the current one is
    written, so at most two batches are held at once; within a batch, source files are read
    concurrently (``read_workers``). The read-ahead runs across shards: the first batch of the
    next shard is read while the last one of this shard is written. Where the storage maps files
    (local), a range is not copied: it is a view of the mapped source file, its chunks
    CRC-checked once, written straight from the page cache; a batch's mappings go when the batch
    has been written.
    """

    def __init__(self, reader: CheckpointReader, ranges: RangeReader, plans: Mapping[str, ReshardPlan],
                 shards: Sequence[int], slots: Sequence[TensorSlot], buffer_bytes: int,
                 on_bytes: Callable[[int], None] | None, read_workers: int = 4) -> None:
        self.ranges, self.on_bytes, self.read_workers = ranges, on_bytes, read_workers
        self.batches = [(t, b) for t in shards
                        for b in plan_batches(reader, plans, t, slots, buffer_bytes) if b]
        self.zeros = bytes(max((p for _, b in self.batches for _, p in b if isinstance(p, int)),
                               default=0))
        self.index = {s.name: i for i, s in enumerate(slots)}
        self.stream = read_ahead(self.batches, self._fetch)
        self.taken = 0  # batches taken from the stream
        self.current: list[tuple[int, Any]] = []
        self.pos = 0

    def _fetch(self, item: tuple[int, list[tuple[int, Any]]]) -> list[tuple[int, Any]]:
        _, batch = item
        data = iter(self.ranges.fetch([p for _, p in batch if not isinstance(p, int)], self.read_workers))
        zview = memoryview(self.zeros)
        return [(si, zview[:p] if isinstance(p, int) else next(data)) for si, p in batch]

    def _advance(self, shard: int) -> bool:
        """Make the shard's next batch current (the read of the one after, maybe of the next
        shard, starts); False at the end of the shard's batches."""
        if self.taken == len(self.batches) or self.batches[self.taken][0] != shard:
            return False
        self.current, self.pos = [], 0  # written: let it go before the next is waited for
        _, self.current = next(self.stream)
        self.taken += 1
        return True

    def for_shard(self, shard: int) -> Callable[[TensorSlot], Iterator[Any]]:
        def produce(slot: TensorSlot) -> Iterator[Any]:
            si = self.index[slot.name]
            while True:
                if self.pos == len(self.current) and not self._advance(shard):
                    return
                owner, piece = self.current[self.pos]
                if owner != si:  # the next slot's bytes: leave them for its call
                    return
                self.pos += 1
                if self.on_bytes:
                    self.on_bytes(len(piece))
                yield piece

        return produce

    def close(self) -> None:
        self.stream.close()  # type: ignore[attr-defined]


def write_shards(reader: CheckpointReader, plans: Mapping[str, ReshardPlan],
                 writer: CheckpointWriter, shards: Sequence[int], buffer_bytes: int,
                 on_bytes: Callable[[int], None] | None = None) -> Written:
    """Write target shards ``shards`` (in that order) with ``writer``, their bytes read from
    ``reader`` through ``plans``."""
    ranges = RangeReader(reader.storage, reader.manifest.chunk_size)
    stream = ShardStream(reader, ranges, plans, shards, writer.slots, buffer_bytes, on_bytes)
    try:
        entries = tuple(writer.write_shard(t, stream.for_shard(t)) for t in shards)
    finally:
        stream.close()
    return Written(entries, ranges.bytes_read)
