"""Reshard a checkpoint of chunked tensors (saved through DCP, as FSDP2 saves) to M ranks.

The target is the checkpoint FSDP2 and DCP's default planner would save at M ranks (HSDP: R
replicas of M/R shard ranks) through ``ShardckptWriter``:

* every floating tensor of at least one dimension is split along dim 0 as ``fully_shard``
  splits a parameter over S shard ranks (torch's ``_chunk_with_empty``: ``torch.chunk``, so
  ``ceil(rows / S)`` rows per rank, the last ranks short or empty) and saved as DTensor
  ``Shard(0)`` boxes are (``compute_local_shape_and_global_offset``: an empty shard is the box
  of 0 rows at offset ``rows``); shard rank ``j`` of every replica holds box ``j``;
* a 0-d tensor or one that is not floating (a step count, an integer buffer) is replicated: one
  box, the whole tensor; blobs (values DCP's planner serialized) are replicated too, and keep
  their bytes; the planner data is kept as it is;
* each rank's save plan lists its items in state-dict order, and DCP's ``dedup_save_plans``
  keeps each box (and each replicated item) once, in the plan of the rank that has the fewest
  bytes planned so far (:func:`dedup`, the same steps): so replicas share the shard boxes and
  the replicated items spread over the ranks;
* one ``chunks`` file per rank that keeps anything, its items in plan order; the mesh is one
  ``dp_shard`` axis of all M ranks, as ``ShardckptWriter`` records it.

A rank of the new job then reads one contiguous range per tensor. The bytes stream through
:class:`~shardckpt.tools.reshard_stream.ShardStream` in batches of at most ``buffer_bytes``:
where the source's boxes span every dim but the first (FSDP2's), a target box is a run of
source byte ranges, read without numpy or torch; other boxes are assembled block by block.

``fmt="flat"`` writes ``ZeroEngine`` flat groups instead, planned as ``import dcp --ranks``
plans them (:func:`shardckpt.interop.dcp.to_flat.flat_spec`; loads torch).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, replace
from collections.abc import Callable, Sequence

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter, new_save_id
from shardckpt.errors import ConfigError
from shardckpt.format.chunk_index import intersection
from shardckpt.format.chunked import (
    Blob, ChunkRecord, ChunkedSection, ChunkedTensor, blob_name, chunk_name, chunks_for,
)
from shardckpt.format.dtypes import FLOATS, itemsize
from shardckpt.format.layout import Mesh, prod
from shardckpt.format.manifest import FileEntry, TensorSlot
from shardckpt.storage import Storage
from shardckpt.tools.reshard_stream import Batcher, Written, stream_files
from shardckpt.tools.reshard_target import ReshardTarget

__all__ = ["fsdp_rows", "Item", "rank_items", "dedup", "ChunkedTarget", "chunked_target"]

FORMATS = ("chunked", "flat")
#: What names a write item in DCP's dedup: its key and, for a tensor's box, the box's offsets.
ItemIndex = tuple[str, tuple[int, ...] | None]


def fsdp_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of shard rank ``rank``'s box of a tensor of ``rows`` rows split over
    ``shards`` ranks along dim 0, as FSDP2 splits it (``torch.chunk``) and DTensor places it
    (``Shard.local_shard_size_and_offset``; an empty shard starts at ``rows``)."""
    size = -(-rows // shards)
    start = min(rows, size * rank)
    n = max(0, min(rows, start + size) - start)
    return (start, n) if n else (rows, 0)


def sharded(t: ChunkedTensor) -> bool:
    """Whether FSDP2 shards the tensor (a floating parameter or its optimizer state)."""
    return bool(t.shape) and t.dtype in FLOATS


@dataclass(frozen=True)
class Item:
    """A write item of a rank's save plan: a box of tensor ``key`` or (``offsets`` None) the
    blob ``key``; ``weight`` is what DCP's dedup counts for it (the tensor's global bytes, at
    least 1; a blob 1)."""

    key: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...]
    weight: int

    @property
    def index(self) -> ItemIndex:
        return self.key, self.offsets


def state_order(section: ChunkedSection) -> list[str]:
    """The keys in state-dict order: the planner data's (the flattened state dict's) order,
    then any key it does not name."""
    order = [k for k in section.planner_data if k in section.tensors or k in section.blobs]
    seen = set(order)
    return order + [k for k in (*section.tensors, *section.blobs) if k not in seen]


def rank_items(section: ChunkedSection, shards: int, world: int) -> list[list[Item]]:
    """Each global rank's save plan before dedup (rank ``r`` is shard rank ``r % shards`` of
    replica ``r // shards``, as ``init_device_mesh((R, S))`` numbers them). Pure."""
    order = state_order(section)
    plans = []
    for r in range(world):
        items = []
        for key in order:
            t = section.tensors.get(key)
            if t is None:
                items.append(Item(key, None, (), 1))
            elif sharded(t):
                start, n = fsdp_rows(t.shape[0], shards, r % shards)
                rest = tuple(t.shape[1:])
                items.append(Item(key, (start, *(0,) * len(rest)), (n, *rest), t.nbytes or 1))
            else:
                items.append(Item(key, (0,) * len(t.shape), tuple(t.shape), t.nbytes or 1))
        plans.append(items)
    return plans


def dedup(plans: Sequence[Sequence[Item]]) -> list[list[Item]]:
    """DCP's ``dedup_save_plans`` (torch 2.13, ``save_to_lowest_rank=False``), step for step:
    an item in several plans stays in the one with the least weight planned so far (ties: as
    ``min`` meets them in the set of plan indices). Pure."""
    where: dict[ItemIndex, set[int]] = defaultdict(set)
    weight: dict[ItemIndex, int] = {}
    keep = [{it.index for it in p} for p in plans]
    for i, p in enumerate(plans):
        for it in p:
            where[it.index].add(i)
            weight[it.index] = it.weight
    planned = [0] * len(plans)
    for index, holders in where.items():
        chosen = min(holders, key=lambda i: planned[i])
        planned[chosen] += weight[index]
        for i in holders - {chosen}:
            keep[i].discard(index)
    return [[it for it in p if it.index in k] for p, k in zip(plans, keep, strict=True)]


def _slots(section: ChunkedSection, items: Sequence[Item]) -> tuple[TensorSlot, ...]:
    """The slots of one rank's chunks file: its items back to back, in plan order."""
    out, pos = [], 0
    for it in items:
        if it.offsets is None:
            n = section.blobs[it.key].nbytes
            out.append(TensorSlot(blob_name(it.key), "uint8", (n,), pos, pos + n))
        else:
            t = section.tensors[it.key]
            n = prod(it.sizes) * itemsize(t.dtype)
            out.append(TensorSlot(chunk_name(it.key, it.offsets), t.dtype, it.sizes, pos, pos + n))
        pos += n
    return tuple(out)


def _file(save_id: str, rank: int) -> str:
    return f"{save_id}/chunks-{rank:05d}.safetensors"


class _Counter:
    """Bytes read by the pieces assembled from boxes (the ranges are counted by the stream)."""

    def __init__(self) -> None:
        self.n = 0


@dataclass(frozen=True)
class ChunkedTarget:
    """Chunks for the ranks of ``mesh`` (module docstring): ``items[r]`` and ``slots[r]``, what
    rank ``r``'s chunks file holds (nothing: no file). A target of :mod:`shardckpt.tools.reshard`."""

    spec: CheckpointSpec          # its chunked section names the files of save "<save-id>"
    source: ChunkedSection
    items: tuple[tuple[Item, ...], ...]
    slots: tuple[tuple[TensorSlot, ...], ...]

    def section(self, save_id: str) -> ChunkedSection:
        """The target's chunked section, its files in save ``save_id``: tensors and blobs in
        the order DCP's metadata lists them (each plan's items, plan by plan)."""
        tensors: dict[str, list[ChunkRecord]] = {}
        blobs: dict[str, Blob] = {}
        for r, (items, slots) in enumerate(zip(self.items, self.slots, strict=True)):
            for it, s in zip(items, slots, strict=True):
                if it.offsets is None:
                    blobs[it.key] = Blob(it.key, _file(save_id, r), s.begin, s.end)
                else:
                    tensors.setdefault(it.key, []).append(
                        ChunkRecord(it.offsets, it.sizes, _file(save_id, r), s.begin, s.end))
        src = self.source.tensors
        return ChunkedSection(
            {k: ChunkedTensor(k, src[k].dtype, src[k].shape, tuple(cs)) for k, cs in tensors.items()},
            blobs, dict(self.source.planner_data))

    def writer(self, dst: Storage, save_id: str | None = None) -> CheckpointWriter:
        save_id = save_id or new_save_id()
        return CheckpointWriter(dst, replace(self.spec, chunked=self.section(save_id)), save_id)

    def data_bytes(self, writer: CheckpointWriter) -> int:
        return sum(s[-1].end for s in self.slots if s)

    def costs(self) -> list[int]:
        """Bytes read plus bytes written, per rank's file."""
        return [2 * s[-1].end if s else 0 for s in self.slots]

    def has_buffers(self, reader: CheckpointReader) -> bool:
        return False

    def write_buffers(self, reader: CheckpointReader, writer: CheckpointWriter,
                      buffer_bytes: int) -> FileEntry | None:
        return None

    def write(self, reader: CheckpointReader, writer: CheckpointWriter, files: Sequence[int],
              buffer_bytes: int, on_bytes: Callable[[int], None] | None) -> Written:
        """Write the chunks files of ranks ``files`` (those that hold anything)."""
        ranks = [r for r in files if self.items[r]]
        batcher, counted = Batcher(buffer_bytes), _Counter()
        for r in ranks:
            for si, it in enumerate(self.items[r]):
                self._pieces(reader, batcher, r, si, it, counted)
        done = stream_files(reader, batcher.batches, ranks,
                            lambda r, produce: writer.write_chunks(r, list(self.slots[r]), produce),
                            lambda r: self.slots[r], on_bytes)
        return Written(done.entries, done.bytes_read + counted.n)

    def _pieces(self, reader: CheckpointReader, batcher: Batcher, rank: int, si: int, it: Item,
                counted: _Counter) -> None:
        """Add the pieces of item ``it`` (slot ``si`` of ``rank``'s file) to ``batcher``."""
        m, budget = reader.manifest, batcher.buffer_bytes
        if it.offsets is None:
            b = self.source.blobs[it.key]
            entry = m.file(b.file)
            reader.check_file(entry)
            base = entry.data_start + b.begin
            for x in range(0, b.nbytes, budget):
                y = min(b.nbytes, x + budget)
                batcher.add(rank, si, (entry, base + x, base + y), y - x)
            return
        t = self.source.tensors[it.key]
        elem = itemsize(t.dtype)
        if not _row_bands(t):  # boxes split other dims: assembled block by block
            from shardckpt.interop.dcp.export import blocks

            for rel, sizes in blocks(it.sizes, elem, budget):
                if prod(sizes):
                    off = tuple(o + r for o, r in zip(it.offsets, rel, strict=True))
                    batcher.add(rank, si, functools.partial(_read_block, reader, t, off, sizes,
                                                            counted), prod(sizes) * elem)
            return
        row = prod(t.shape[1:]) if t.shape else 1
        lo = it.offsets[0] * row if t.shape else 0
        hi = lo + prod(it.sizes)
        per = max(1, budget // elem)
        found = chunks_for(t, it.offsets, it.sizes)
        for c in sorted(found, key=lambda c: c.offsets[0] if c.offsets else 0):
            c_lo = c.offsets[0] * row if t.shape else 0
            first, stop = max(lo, c_lo), min(hi, c_lo + c.numel)
            if first >= stop:
                continue
            entry = m.file(c.file)
            reader.check_file(entry)
            base = entry.data_start + c.begin
            for x in range(first, stop, per):
                y = min(stop, x + per)
                batcher.add(rank, si, (entry, base + (x - c_lo) * elem, base + (y - c_lo) * elem),
                            (y - x) * elem)


def _row_bands(t: ChunkedTensor) -> bool:
    """Whether every box of ``t`` spans all of every dim but the first: a box is then a run of
    the tensor's row-major bytes (0-d tensors too)."""
    return all(tuple(c.sizes[1:]) == tuple(t.shape[1:]) for c in t.chunks if c.numel)


def _read_block(reader: CheckpointReader, t: ChunkedTensor, offsets: Sequence[int],
                sizes: Sequence[int], counted: _Counter) -> bytes:
    """The global box (``offsets``, ``sizes``) of ``t`` as row-major bytes, assembled from the
    boxes it meets (each read is the smallest span of a box that holds its part)."""
    import numpy as np

    from shardckpt.checkpoint.chunked_read import read_box

    elem = itemsize(t.dtype)
    out = np.empty((*sizes, elem), np.uint8)
    for c in chunks_for(t, offsets, sizes):
        box = intersection(c.offsets, c.sizes, offsets, sizes)
        if box is None:
            continue
        data = read_box(reader, t, c, *box)
        counted.n += len(data)
        out[tuple(slice(o - b, o - b + k) for o, b, k in zip(box[0], offsets, box[1], strict=True))] = \
            np.frombuffer(data, np.uint8).reshape((*box[1], elem))
    return out.tobytes()


def plan_chunks(source: ChunkedSection, mesh: Mesh) -> tuple[tuple[Item, ...], ...]:
    """Each rank's items after dedup, for ``mesh`` (R x S). Pure."""
    plans = dedup(rank_items(source, mesh.shard_degree, mesh.world_size))
    return tuple(tuple(p) for p in plans)


def chunked_target(reader: CheckpointReader, mesh: Mesh, fmt: str | None = None) -> ReshardTarget:
    """The target of resharding the chunked checkpoint of ``reader`` for ``mesh``: chunks
    (``fmt`` None or ``"chunked"``) or flat groups (``"flat"``)."""
    m = reader.manifest
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    if m.chunked is None:
        raise ConfigError(f"{reader.url} holds flat groups; reshard writes them as flat groups "
                          "(--format flat); `shardckpt export dcp` writes DCP's chunks")
    if m.components:
        raise ConfigError(f"{reader.url} holds flat groups beside chunked tensors; reshard "
                          "rewrites a checkpoint of one kind")
    if fmt == "flat":
        from shardckpt.tools.reshard_to_flat import flat_target

        return flat_target(reader, mesh)
    items = plan_chunks(m.chunked, mesh)
    spec = CheckpointSpec(Mesh.for_world(mesh.world_size), {}, m.optimizer, dict(m.extras),
                          dict(m.per_rank_state), m.chunk_size)
    target = ChunkedTarget(spec, m.chunked, items, tuple(_slots(m.chunked, p) for p in items))
    return replace(target, spec=replace(spec, chunked=target.section("<save-id>")))
