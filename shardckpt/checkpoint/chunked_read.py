"""Reading chunked tensors (format 1.2) through a checkpoint reader: boxes, blobs, whole tensors
in bounded bands. The records are in :mod:`shardckpt.format.chunked`, the pure box arithmetic in
:mod:`shardckpt.format.chunk_index`; this is the I/O side, used by consolidate, diff and the DCP
reader. Every read goes through a :class:`RangeSource`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from collections.abc import Iterator, Sequence

from shardckpt.format.chunk_index import intersection, row_bands
from shardckpt.format.chunked import Blob, ChunkRecord, ChunkedTensor, box_byte_span, chunks_for
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import prod
from shardckpt.checkpoint.pieces import Piece

if TYPE_CHECKING:
    from shardckpt.format.manifest import FileEntry, Manifest


@runtime_checkable
class RangeSource(Protocol):
    """Checked ranged reads of one checkpoint's files: a
    :class:`~shardckpt.checkpoint.reader.CheckpointReader`, or one that wraps it (to count the
    bytes it reads)."""

    @property
    def manifest(self) -> Manifest:
        """The checkpoint's manifest: where each chunk and blob lies."""
        ...

    @property
    def url(self) -> str:
        """Where the checkpoint is, for messages."""
        ...

    def read_ranges(self, requests: list[tuple[FileEntry, int, int]],
                    workers: int = 8) -> list[memoryview]:
        """The bytes ``[start, end)`` of each ``(file, start, end)``, every chunk checked."""
        ...


def read_box(reader: RangeSource, t: ChunkedTensor, c: ChunkRecord, offsets: Sequence[int],
             sizes: Sequence[int]) -> bytes:
    """The elements of the global box (``offsets``, ``sizes``), inside chunk ``c``, as row-major
    bytes (checked reads of only the span of ``c`` that holds the box)."""
    import numpy as np

    elem = itemsize(t.dtype)
    rel = tuple(o - co for o, co in zip(offsets, c.offsets, strict=True))
    a, b = box_byte_span(c, elem, rel, sizes)
    if a == b:
        return b""
    entry = reader.manifest.file(c.file)
    base = entry.data_start + c.begin
    view = reader.read_ranges([(entry, base + a, base + b)])[0]
    strides = [elem] * len(c.sizes)
    for i in range(len(c.sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * c.sizes[i + 1]
    raw = np.frombuffer(view, np.dtype(f"V{elem}"))
    box = np.lib.stride_tricks.as_strided(raw, tuple(sizes), tuple(strides), writeable=False)
    return np.ascontiguousarray(box).tobytes()


def read_blob(reader: RangeSource, b: Blob) -> bytes:
    """A blob's bytes, checked."""
    entry = reader.manifest.file(b.file)
    return bytes(reader.read_ranges([(entry, entry.data_start + b.begin, entry.data_start + b.end)])[0])


def iter_tensor_bands(reader: RangeSource, t: ChunkedTensor, budget: int) -> Iterator[tuple[int, bytes]]:
    """(first element, row-major bytes) of the whole tensor ``t`` in bands along dim 0 of at most
    ``budget`` bytes (at least one row), each assembled from the chunks it meets: memory is one
    band, whatever the tensor or chunk size."""
    elem = itemsize(t.dtype)
    if not t.shape:
        yield 0, read_box(reader, t, t.chunks[0], (), ())
        return
    row = prod(t.shape[1:])
    for off, size in row_bands((0,) * len(t.shape), t.shape, elem, budget):
        if not prod(size):
            continue
        yield off[0] * row, read_rows(reader, t, off[0], size[0])


def read_rows(reader: RangeSource, t: ChunkedTensor, first: int, n: int) -> bytes:
    """Rows ``[first, first + n)`` (along dim 0) of tensor ``t`` (at least 1-D) as row-major
    bytes, assembled from the chunks they meet."""
    import numpy as np

    elem = itemsize(t.dtype)
    off, size = (first, *(0,) * (len(t.shape) - 1)), (n, *t.shape[1:])
    band = np.empty((*size, elem), np.uint8)
    for c in chunks_for(t, off, size):
        box = intersection(c.offsets, c.sizes, off, size)
        if box is None:
            continue
        data = np.frombuffer(read_box(reader, t, c, *box), np.uint8).reshape((*box[1], elem))
        band[tuple(slice(o - b, o - b + k) for o, b, k in zip(box[0], off, box[1], strict=True))] = data
    return band.tobytes()


def iter_elements(reader: RangeSource, t: ChunkedTensor, start: int, end: int,
                  budget: int) -> Iterator[bytes]:
    """Elements ``[start, end)`` of tensor ``t`` in row-major order, as bytes, in pieces of
    whole rows of at most ``budget`` bytes (at least one row) trimmed to the range."""
    elem = itemsize(t.dtype)
    if start >= end:
        return
    if not t.shape:
        yield read_box(reader, t, t.chunks[0], (), ())
        return
    row = prod(t.shape[1:])
    r0, r1 = start // row, (end - 1) // row + 1
    step = max(1, budget // max(1, row * elem))
    for r in range(r0, r1, step):
        n = min(step, r1 - r)
        data = read_rows(reader, t, r, n)
        lo, hi = max(start, r * row) - r * row, min(end, (r + n) * row) - r * row
        yield data[lo * elem:hi * elem]


class ChunkedPieces:
    """The piece-engine interface of :class:`shardckpt.checkpoint.pieces.PieceReader` over chunked tensors
    of one checkpoint: ``pieces(items)`` yields ``(index, start, end, (bytes,))`` in order for
    items ``(numel, (source,))`` whose ``source.fqn`` names a chunked tensor."""

    def __init__(self, reader: RangeSource, buffer_bytes: int) -> None:
        self.reader, self.buffer_bytes, self.bytes_read = reader, buffer_bytes, 0

    def pieces(self, items: Sequence[tuple[int, Sequence[Any]]]) -> Iterator[Piece]:
        section = self.reader.manifest.chunked
        assert section is not None, "pieces of chunked tensors come from a chunked section"
        for i, (_, (src, *_)) in enumerate(items):
            t = section.tensors[src.fqn]
            elem = itemsize(t.dtype)
            for start, data in iter_tensor_bands(self.reader, t, self.buffer_bytes):
                self.bytes_read += len(data)
                yield Piece(i, start, start + len(data) // elem, (data,))
