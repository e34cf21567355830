"""Chunked tensors: the part of a manifest that describes tensors the way
``torch.distributed.checkpoint`` (DCP) shards them, and opaque blobs. Pure; no torch.

A chunked tensor has a global shape and dtype and a set of N-D boxes (``offsets``, ``sizes``),
each stored whole, row-major, as one tensor of a ``chunks`` file, at bytes ``[begin, end)`` of
that file's data section. A blob is a byte string that a planner serialized itself; it is stored
as a ``uint8`` tensor and shardckpt never interprets its bytes. docs/FORMAT.md section 13 is the
specification; :func:`parse_section` refuses a box outside its tensor, two boxes that overlap, a
tensor its boxes do not tile, and a byte range outside the file that holds it.

This module holds the records, their codec and the readers' queries (:func:`chunks_for`,
:func:`iter_pairs`); whether a tensor's boxes tile it is :mod:`shardckpt.format.chunk_tiling`,
and the index the queries go through :mod:`shardckpt.format.chunk_index`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

from shardckpt.format.chunk_index import ChunkIndex, IndexWork, intersection, row_bands
from shardckpt.format.chunk_tiling import overlap, tiling_problems
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import prod
from shardckpt.format.parse_context import ParseContext, listed

#: Feature name a manifest with a chunked section lists in ``requires``.
FEATURE = "chunked_tensors"
ROLE = "chunks"
#: Chunks a single tensor may have (DCP writes one per rank holding a distinct piece).
MAX_CHUNKS = 1 << 20


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One stored box of a tensor: its position in the tensor and its bytes in ``file``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    begin: int  # relative to the start of the file's data section, like safetensors offsets
    end: int

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass(frozen=True)
class ChunkedTensor:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def index(self, work: IndexWork | None = None) -> ChunkIndex:
        """The :class:`ChunkIndex` of this tensor's chunks, built on first use (``work``, if
        given, counts the building then) and kept on the record for every later query."""
        idx = self.__dict__.get("_index")
        if idx is None:
            idx = ChunkIndex(self.chunks, work)
            self.__dict__["_index"] = idx  # a cache: not a field, so equality and repr ignore it
        return idx

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_index"}


@dataclass(frozen=True, slots=True)
class Blob:
    """Bytes a planner serialized itself (DCP: ``torch.save`` of a non-tensor value); opaque."""

    key: str
    file: str
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ChunkedSection:
    tensors: Mapping[str, ChunkedTensor]
    blobs: Mapping[str, Blob] = field(default_factory=dict)
    #: DCP's planner data (the default planner's flattening map: key -> path of str / int).
    planner_data: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)

    def files(self) -> set[str]:
        return ({c.file for t in self.tensors.values() for c in t.chunks}
                | {b.file for b in self.blobs.values()})


def chunk_name(fqn: str, offsets: Sequence[int]) -> str:
    """The safetensors name of a stored box: ``<fqn>@<offsets, comma-separated>``."""
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


def blob_name(key: str) -> str:
    """The safetensors name of a blob (never equal to a chunk name: those end in ``@digits``)."""
    return f"{key}#blob"


# ------------------------------------------------------------------------------------ encode


def section_doc(s: ChunkedSection) -> dict[str, Any]:
    return {
        "tensors": [
            {"fqn": t.fqn, "dtype": t.dtype, "shape": list(t.shape),
             "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file,
                         "begin": c.begin, "end": c.end} for c in t.chunks]}
            for t in s.tensors.values()
        ],
        "blobs": [{"key": b.key, "file": b.file, "begin": b.begin, "end": b.end}
                  for b in s.blobs.values()],
        "planner_data": {k: list(v) for k, v in s.planner_data.items()},
    }


# ------------------------------------------------------------------------------------ decode


def parse_section(ctx: ParseContext, v: Any, data_sizes: Mapping[str, int]) -> ChunkedSection:
    """Decode and validate the ``chunked`` section with the manifest's validation context ``ctx``;
    ``data_sizes`` maps each ``chunks`` file's path to the size of its data section."""
    w = "chunked"
    d = ctx.obj(v, w)
    tensors: dict[str, ChunkedTensor] = {}
    for i, td in enumerate(ctx.lst(ctx.key(d, "tensors", w), f"{w}.tensors")):
        t = _parse_tensor(ctx, f"{w}.tensors[{i}]", td, data_sizes)
        if t.fqn in tensors:
            raise ctx.fail(f"{w}.tensors[{i}]", f"tensor {t.fqn!r} appears twice")
        tensors[t.fqn] = t
    blobs: dict[str, Blob] = {}
    for i, bd in enumerate(ctx.lst(d.get("blobs", []), f"{w}.blobs")):
        bw = f"{w}.blobs[{i}]"
        bd = ctx.obj(bd, bw)
        key = ctx.str_(ctx.key(bd, "key", bw), f"{bw}.key")
        path, begin, end = _parse_range(ctx, bw, bd, data_sizes)
        if key in blobs or key in tensors:
            raise ctx.fail(bw, f"{key!r} names another blob or tensor too")
        blobs[key] = Blob(key, path, begin, end)
    planner: dict[str, tuple[str | int, ...]] = {}
    for k, p in ctx.obj(d.get("planner_data", {}), f"{w}.planner_data").items():
        pw = f"{w}.planner_data.{k[:64]}"
        ctx.str_(k, pw)
        steps = ctx.lst(p, pw)
        if len(steps) > 64 or not all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))
                                      for x in steps):
            raise ctx.fail(pw, "expected a list of at most 64 strings and integers")
        planner[k] = tuple(ctx.str_(x, pw) if isinstance(x, str) else ctx.int_(x, pw) for x in steps)
    section = ChunkedSection(tensors, blobs, planner)
    overlaps = byte_overlaps(section)
    if overlaps:
        raise ctx.fail(w, f"byte ranges overlap in a file: {listed(overlaps)}")
    return section


def _parse_range(ctx: ParseContext, w: str, d: dict[str, Any], data_sizes: Mapping[str, int]) -> tuple[str, int, int]:
    path = ctx.str_(ctx.key(d, "file", w), f"{w}.file")
    if path not in data_sizes:
        raise ctx.fail(f"{w}.file", f"{path!r} is not a {ROLE!r} file of this manifest")
    begin = ctx.int_(ctx.key(d, "begin", w), f"{w}.begin")
    end = ctx.int_(ctx.key(d, "end", w), f"{w}.end")
    if not begin <= end <= data_sizes[path]:
        raise ctx.fail(w, f"bytes [{begin}, {end}) of the data section of {path} are past its end "
                       f"({data_sizes[path]} bytes) or reversed")
    return path, begin, end


def _parse_tensor(ctx: ParseContext, w: str, v: Any, data_sizes: Mapping[str, int]) -> ChunkedTensor:
    d = ctx.obj(v, w)
    fqn = ctx.str_(ctx.key(d, "fqn", w), f"{w}.fqn")
    dtype = ctx.dtype(ctx.key(d, "dtype", w), f"{w}.dtype")
    shape = ctx.shape(ctx.key(d, "shape", w), f"{w}.shape")
    chunks_doc = ctx.lst(ctx.key(d, "chunks", w), f"{w}.chunks")
    if len(chunks_doc) > MAX_CHUNKS:
        raise ctx.fail(f"{w}.chunks", f"{len(chunks_doc)} chunks; at most {MAX_CHUNKS} are allowed")
    chunks = []
    for j, cd in enumerate(chunks_doc):
        cw = f"{w}.chunks[{j}]"
        cd = ctx.obj(cd, cw)
        offsets = tuple(ctx.int_(o, f"{cw}.offsets") for o in
                        ctx.lst(ctx.key(cd, "offsets", cw), f"{cw}.offsets")[:17])
        sizes = ctx.shape(ctx.key(cd, "sizes", cw), f"{cw}.sizes")
        path, begin, end = _parse_range(ctx, cw, cd, data_sizes)
        c = ChunkRecord(offsets, sizes, path, begin, end)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ctx.fail(cw, f"{fqn!r} has {len(shape)} dimensions but the chunk's offsets and "
                           f"sizes have {len(offsets)} and {len(sizes)}")
        if end - begin != c.numel * itemsize(dtype):
            raise ctx.fail(cw, f"{fqn!r}: bytes [{begin}, {end}) of {path} hold {end - begin} bytes, "
                           f"but a {list(sizes)} box of {dtype} needs {c.numel * itemsize(dtype)}")
        chunks.append(c)
    t = ChunkedTensor(fqn, dtype, shape, tuple(chunks))
    problems = tiling_problems(t)
    if problems:
        raise ctx.fail(w, f"{fqn!r}: {listed(problems)}")
    return t


def byte_overlaps(s: ChunkedSection) -> list[str]:
    """Byte ranges of two chunks or blobs that overlap in one file."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for t in s.tensors.values():
        for c in t.chunks:
            if c.end > c.begin:
                spans.setdefault(c.file, []).append((c.begin, c.end, chunk_name(t.fqn, c.offsets)))
    for b in s.blobs.values():
        if b.end > b.begin:
            spans.setdefault(b.file, []).append((b.begin, b.end, blob_name(b.key)))
    out = []
    for path, items in spans.items():
        items.sort()
        out += [f"{path}: {q[2]} [{q[0]}, {q[1]}) and {p[2]} [{p[0]}, {p[1]})"
                for p, q in itertools.pairwise(items) if q[0] < p[1]]
    return out


# ------------------------------------------------------------------------------- for readers


def file_layout(s: ChunkedSection, path: str) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """(name, dtype, shape, begin, end) of every tensor file ``path`` holds, in byte order."""
    out = [(chunk_name(t.fqn, c.offsets), t.dtype, c.sizes, c.begin, c.end)
           for t in s.tensors.values() for c in t.chunks if c.file == path]
    out += [(blob_name(b.key), "uint8", (b.nbytes,), b.begin, b.end)
            for b in s.blobs.values() if b.file == path]
    return sorted(out, key=lambda x: (x[3], x[4]))


def box_byte_span(c: ChunkRecord, elem: int, offsets: Sequence[int],
                  lengths: Sequence[int]) -> tuple[int, int]:
    """Bytes ``[a, b)`` (relative to the chunk's first byte) of the smallest contiguous span of
    the row-major box ``c`` that holds the sub-box at ``offsets`` (relative to the chunk) with
    ``lengths``. An empty sub-box spans nothing."""
    if prod(lengths) == 0:
        return 0, 0
    strides = [1] * len(c.sizes)
    for i in range(len(c.sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * c.sizes[i + 1]
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    return first * elem, (last + 1) * elem


def chunks_for(t: ChunkedTensor, offsets: Sequence[int], sizes: Sequence[int],
               work: IndexWork | None = None) -> list[ChunkRecord]:
    """The chunks of ``t`` that share elements with the box (``offsets``, ``sizes``), in the
    order ``t`` lists them: a query of the tensor's :class:`ChunkIndex` (built once per tensor),
    O(log n + m) steps (and a sort of m positions) for the m chunks that meet the box's rows
    (dim 0): the chunks returned, for a band that spans the other dims as the readers' bands do.
    ``work``, if given, counts the steps (and the building, if this query builds the index)."""
    chunks = t.chunks
    rows = t.index(work).query(offsets, sizes, work)
    if len(sizes) < 2:
        return [chunks[i] for i in rows]
    if work is not None:
        work.queried += len(rows)
    return [c for c in (chunks[i] for i in rows) if overlap(c.offsets, c.sizes, offsets, sizes)]


def iter_pairs(ta: ChunkedTensor, tb: ChunkedTensor, budget: int
               ) -> Iterator[tuple[ChunkRecord, ChunkRecord, tuple[int, ...], tuple[int, ...]]]:
    """Every (chunk of a, chunk of b, band) whose elements both hold, bands within ``budget``
    bytes: what comparing two equally shaped tensors element by element reads."""
    elem = max(itemsize(ta.dtype), itemsize(tb.dtype))
    for ca in ta.chunks:
        for cb in chunks_for(tb, ca.offsets, ca.sizes):
            box = intersection(ca.offsets, ca.sizes, cb.offsets, cb.sizes)
            if box is not None:
                for off, size in row_bands(box[0], box[1], elem, budget):
                    yield ca, cb, off, size
