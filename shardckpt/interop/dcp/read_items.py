"""The byte ranges a DCP load plan names in a chunked shardckpt checkpoint, read and handed to
the planner: used by :class:`shardckpt.interop.dcp.storage.ShardckptReader`."""

from __future__ import annotations

import warnings
from typing import Any
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import ManifestError
from shardckpt.format.chunked import ChunkRecord, ChunkedTensor, box_byte_span
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import prod
from shardckpt.format.manifest import FileEntry

#: (fqn, offsets) -> (tensor, stored chunk): every chunk of a checkpoint's chunked tensors
Chunks = dict[tuple[str, tuple[int, ...]], tuple[ChunkedTensor, ChunkRecord]]


def read_values(r: CheckpointReader, chunks: Chunks, items: list[ReadItem], batch_bytes: int,
                workers: int, check: Callable[[bytes, str, str], None]) -> list[tuple[ReadItem, bytes]]:
    """The bytes of each value item, in batches of at most ``batch_bytes``, each passed to
    ``check(data, key, file)`` before any is returned."""
    out: list[tuple[ReadItem, bytes]] = []
    batch: list[tuple[ReadItem, FileEntry, tuple[FileEntry, int, int]]] = []
    size = 0

    def flush() -> None:
        views = r.read_ranges([req for _, _, req in batch], workers=workers)
        for (item, entry, _), view in zip(batch, views, strict=True):
            data = bytes(view)
            check(data, item.storage_index.fqn, entry.path)
            out.append((item, data))
        batch.clear()

    for item in items:
        entry, a, b, _ = locate(r, chunks, item)
        batch.append((item, entry, (entry, a, b)))
        size += b - a
        if size >= batch_bytes:
            flush()
            size = 0
    if batch:
        flush()
    return out


def locate(r: CheckpointReader, chunks: Chunks, item: ReadItem) -> tuple[FileEntry, int, int, Any]:
    """(file, first byte, end byte, (tensor, chunk) or None for a value) of ``item``: the
    smallest span of its stored chunk that holds the requested box."""
    section = r.manifest.chunked
    assert section is not None
    fqn = item.storage_index.fqn
    if item.type == LoadItemType.BYTE_IO:
        blob = section.blobs.get(fqn)
        if blob is None:
            raise ManifestError(f"{r.url}: no value {fqn!r} in the checkpoint")
        entry = r.manifest.file(blob.file)
        return entry, entry.data_start + blob.begin, entry.data_start + blob.end, None
    off = tuple(item.storage_index.offset or ())
    found = chunks.get((fqn, off))
    if found is None:
        raise ManifestError(f"{r.url}: no chunk of {fqn!r} at offsets {list(off)}")
    t, chunk = found
    entry = r.manifest.file(chunk.file)
    a, b = box_byte_span(chunk, itemsize(t.dtype), item.storage_offsets, item.lengths)
    base = entry.data_start + chunk.begin
    return entry, base + a, base + b, (t, chunk)


def box_tensor(view: memoryview, dtype: str, chunk: ChunkRecord, lengths: Any) -> torch.Tensor:
    """The requested box as a (strided) tensor over ``view``, which starts at its first element."""
    lengths = tuple(lengths)
    if prod(lengths) == 0:
        return torch.empty(lengths, dtype=getattr(torch, dtype))
    strides = [1] * len(chunk.sizes)
    for i in range(len(chunk.sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * chunk.sizes[i + 1]
    with warnings.catch_warnings():  # read-only bytes: the tensor is only copied from
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view, dtype=torch.uint8)
    flat = flat.view(getattr(torch, dtype))
    return torch.as_strided(flat, lengths, tuple(strides))
