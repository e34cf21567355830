"""Chunked tensors: the part of a manifest that describes tensors the way
``torch.distributed.checkpoint`` (DCP) shards them, and opaque blobs. Pure; no torch.

A chunked tensor has a global shape and dtype and a set of N-D boxes (``offsets``, ``sizes``),
each stored whole, row-major, as one tensor of a ``chunks`` file, at bytes ``[begin, end)`` of
that file's data section. A blob is a byte string that a planner serialized itself; it is stored
as a ``uint8`` tensor and shardckpt never interprets its bytes. docs/FORMAT.md section 13 is the
specification; :func:`parse_section` refuses a box outside its tensor, two boxes that overlap, a
tensor its boxes do not tile, and a byte range outside the file that holds it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import prod
from shardckpt.format.parse_context import MAX_LISTED, ParseContext, listed

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


# ------------------------------------------------------------------------------------ checks


def _box(c: ChunkRecord) -> str:
    return f"offsets {list(c.offsets)} sizes {list(c.sizes)}"


def overlap(a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int],
            b_size: Sequence[int]) -> bool:
    """Do two N-D boxes share an element? (Empty boxes share none.)"""
    if prod(a_size) == 0 or prod(b_size) == 0:
        return False
    return all(a < b + m and b < a + n for a, n, b, m in zip(a_off, a_size, b_off, b_size, strict=True))


@dataclass
class TilingWork:
    """What :func:`tiling_problems` did, for whoever wants to see that it stays linear: corner
    counts updated (the exact-cover test) and pairs of boxes compared (the overlap search)."""

    corners: int = 0
    pairs: int = 0

    @property
    def total(self) -> int:
        return self.corners + self.pairs


#: The exact-cover test counts 2^d corners per box over the d dimensions the boxes split; above
#: this many dimensions it is skipped for the overlap search alone.
MAX_CORNER_DIMS = 6
#: The overlap search stops after this many box comparisons per box (plus a constant): enough
#: for any tiling whose boxes each meet a bounded number of others.
PAIR_BUDGET = 32


def tiling_problems(t: ChunkedTensor, work: TilingWork | None = None) -> list[str]:
    """Every box outside the shape; else the pairs of boxes that overlap (at most
    ``MAX_LISTED + 1``); else, if the boxes leave elements uncovered, how many they hold: the
    boxes of a tensor must tile it exactly. ``work``, if given, counts what was done.

    Work O(n log n + n 2^d) for ``n`` boxes splitting ``d`` dimensions: whether the boxes tile
    the shape exactly is decided by counting their corners (:func:`_exact_cover`, for ``d`` up to
    :data:`MAX_CORNER_DIMS`); the overlapping pairs of boxes that do not are found by a sweep
    (:func:`_overlapping_pairs`) that stops after :data:`PAIR_BUDGET` steps per box. Only boxes
    laid out to defeat the sweep reach that; the answer then says the boxes overlap without
    naming two, or, past ``MAX_CORNER_DIMS`` split dims, that they could not be checked."""
    work = work if work is not None else TilingWork()
    out = [f"chunk {_box(c)} lies outside the shape {list(t.shape)}"
           for c in t.chunks if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, t.shape, strict=True))]
    if out:
        return out
    live = [c for c in t.chunks if c.numel]
    covered, total = sum(c.numel for c in live), t.numel
    # dims no box splits (every box spans all of it) cannot tell boxes apart: leave them out
    dims = [i for i in range(len(t.shape))
            if any(c.offsets[i] or c.sizes[i] != t.shape[i] for c in live)]
    exact = None
    if covered == total and len(dims) <= MAX_CORNER_DIMS:
        exact = _exact_cover(t.shape, live, dims, work)
        if exact:
            return []
    pairs, complete = _overlapping_pairs(live, dims, work)
    out = [f"chunks {_box(a)} and {_box(b)} overlap" for a, b in pairs]
    if out:
        return out
    if covered != total and (complete or covered < total):
        return [f"its chunks hold {covered} of its {total} elements; a chunked tensor must be "
                "stored whole"]
    if complete:  # disjoint, and as many elements as the shape: a tiling
        return []
    if covered > total or exact is False:  # some element is in two boxes; the search gave up
        return [f"some of its {len(live)} chunks overlap (they hold {covered} elements, it has "
                f"{total}); too many chunks meet one another to name two"]
    return [f"its {len(live)} chunks split {len(dims)} dimensions in too many ways to check that "
            "they tile it"]


def _exact_cover(shape: Sequence[int], live: Sequence[ChunkRecord], dims: Sequence[int],
                 work: TilingWork) -> bool:
    """Whether the boxes ``live`` cover every element of ``shape`` exactly once.

    A sum of box indicators is determined by its corner counts (its mixed finite difference): a
    box ``[a, b)`` contributes ``+1`` or ``-1`` at each of its 2^d corners (the sign the parity of
    the upper ends it takes). The boxes tile the shape exactly when their corner counts, summed,
    are the shape's own. Dims no box splits add the same factor to every box and are left out."""
    counts: dict[tuple[int, ...], int] = {}
    ends = [(0, shape[i]) for i in dims]
    for corner in itertools.product(*([(e, -1 if k else 1) for k, e in enumerate(pair)]
                                      for pair in ends)):
        key = tuple(x for x, _ in corner)
        counts[key] = counts.get(key, 0) - prod(s for _, s in corner)
    signs = list(itertools.product((1, -1), repeat=len(dims)))
    sign = [prod(s) for s in signs]
    for c in live:
        lo = [c.offsets[i] for i in dims]
        hi = [c.offsets[i] + c.sizes[i] for i in dims]
        for pick, sg in zip(signs, sign, strict=True):
            key = tuple(x if p == 1 else y for p, x, y in zip(pick, lo, hi, strict=True))
            counts[key] = counts.get(key, 0) + sg
        work.corners += len(signs)
    return not any(counts.values())


def _overlapping_pairs(live: Sequence[ChunkRecord], dims: Sequence[int], work: TilingWork
                       ) -> tuple[list[tuple[ChunkRecord, ChunkRecord]], bool]:
    """Pairs of boxes that share an element (at most ``MAX_LISTED + 1``), and whether the search
    was complete (it stops once that many are found, or after :data:`PAIR_BUDGET` steps per box).

    A sweep along the dim ``a`` the boxes split most: boxes in the order they start there, the
    active ones (still open at that point) kept sorted by where they start along the next two
    most split dims ``b`` and ``c``. A new box can only meet an active box that starts, along
    ``b``, in ``[lo - longest, hi)`` (``longest``: the longest active box along ``b``) and the
    same along ``c``; those are found by bisection, group by group of equal start along ``b``.
    In a tiling (disjoint, and split along at most three dims) each box meets a bounded number
    of candidates; every candidate and every group visited counts as a step."""
    if not live:
        return [], True
    budget, spent = PAIR_BUDGET * len(live) + 4096, work.pairs
    by_split = sorted(dims, key=lambda i: -len({c.offsets[i] for c in live}))
    a, b, c3 = (by_split + [None, None, None])[:3]

    def span(k: int, d: int | None) -> tuple[int, int]:
        box = live[k]
        return (box.offsets[d], box.offsets[d] + box.sizes[d]) if d is not None else (0, 1)

    def key(k: int) -> tuple[int, int, int]:
        return span(k, b)[0], span(k, c3)[0], k

    order = sorted(range(len(live)), key=lambda k: span(k, a)[0])
    ending: list[tuple[int, int]] = []  # (end along a, index) of the active boxes
    longest: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])  # (-length, index)
    active = _SortedKeys()
    is_active: set[int] = set()
    out: list[tuple[ChunkRecord, ChunkRecord]] = []

    def reach(heap: list[tuple[int, int]]) -> int:
        while heap and heap[0][1] not in is_active:
            heapq.heappop(heap)
        return -heap[0][0] if heap else 0

    def candidates(k: int) -> Iterator[int]:
        (lo_b, hi_b), (lo_c, hi_c) = span(k, b), span(k, c3)
        from_b, from_c = lo_b - reach(longest[0]) + 1, lo_c - reach(longest[1]) + 1
        if c3 is None:
            for _, _, j in active.between((from_b,), (hi_b,)):
                yield j
            return
        first = active.ceiling((from_b,))
        while first is not None and first[0] < hi_b:
            work.pairs += 1  # a group of equal start along b
            for _, _, j in active.between((first[0], from_c), (first[0], hi_c)):
                yield j
            first = active.ceiling((first[0], _AFTER))

    for k in order:
        here = span(k, a)[0]
        while ending and ending[0][0] <= here:
            _, j = heapq.heappop(ending)
            active.remove(key(j))
            is_active.discard(j)
        box = live[k]
        for j in candidates(k):
            work.pairs += 1
            o = live[j]
            if overlap(o.offsets, o.sizes, box.offsets, box.sizes):
                out.append((o, box))
                if len(out) > MAX_LISTED:
                    return out, False
            if work.pairs - spent > budget:
                return out, False
        if work.pairs - spent > budget:
            return out, False
        active.add(key(k))
        is_active.add(k)
        heapq.heappush(ending, (span(k, a)[1], k))
        for heap, d in zip(longest, (b, c3), strict=True):
            lo, hi = span(k, d)
            heapq.heappush(heap, (lo - hi, k))
    return out, True


#: Above every integer: ``(x, _AFTER)`` sorts after every key ``(x, ...)``.
_AFTER = float("inf")


class _SortedKeys:
    """Keys kept sorted in buckets of at most ``2 * LOAD``: add, remove and the neighbours of a
    key in O(log n + LOAD) steps (one sorted list would move O(n) items on each insertion)."""

    LOAD = 256

    def __init__(self) -> None:
        self.buckets: list[list[Any]] = []
        self.maxes: list[Any] = []

    def add(self, key: Any) -> None:
        if not self.buckets:
            self.buckets, self.maxes = [[key]], [key]
            return
        i = min(bisect.bisect_left(self.maxes, key), len(self.maxes) - 1)
        bucket = self.buckets[i]
        bisect.insort(bucket, key)
        self.maxes[i] = bucket[-1]
        if len(bucket) > 2 * self.LOAD:
            self.buckets[i:i + 1] = [bucket[:self.LOAD], bucket[self.LOAD:]]
            self.maxes[i:i + 1] = [bucket[self.LOAD - 1], bucket[-1]]

    def remove(self, key: Any) -> None:
        i = bisect.bisect_left(self.maxes, key)
        bucket = self.buckets[i]
        del bucket[bisect.bisect_left(bucket, key)]
        if bucket:
            self.maxes[i] = bucket[-1]
        else:
            del self.buckets[i], self.maxes[i]

    def between(self, lo: Any, hi: Any) -> Iterator[Any]:
        """Keys ``k`` with ``lo <= k < hi``, ascending."""
        i = bisect.bisect_left(self.maxes, lo)
        j = bisect.bisect_left(self.buckets[i], lo) if i < len(self.buckets) else 0
        while i < len(self.buckets):
            bucket = self.buckets[i]
            while j < len(bucket):
                if bucket[j] >= hi:
                    return
                yield bucket[j]
                j += 1
            i, j = i + 1, 0

    def ceiling(self, key: Any) -> Any:
        """The smallest key at or above ``key``, or None."""
        i = bisect.bisect_left(self.maxes, key)
        if i == len(self.buckets):
            return None
        bucket = self.buckets[i]
        return bucket[bisect.bisect_left(bucket, key)]


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


# --------------------------------------------------------------------- helpers for readers


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


@dataclass
class IndexWork:
    """What a :class:`ChunkIndex` did, for whoever wants to see that it stays O(n log n): steps
    spent building it (an entry partitioned at one level of the tree) and answering queries
    (a tree node, an entry or a bisection step looked at)."""

    built: int = 0
    queried: int = 0

    @property
    def total(self) -> int:
        return self.built + self.queried


class ChunkIndex:
    """The chunks of one tensor indexed by their extent along dim 0, for the box queries of the
    readers (a band of rows, a chunk of another tensor).

    The chunks that meet rows ``[lo, hi)`` are those that start in ``(lo, hi)`` (one bisection in
    the starts, sorted) and those that hold row ``lo`` (a stabbing query of a centered interval
    tree: each node keeps the extents that hold its center, sorted by start and by end; a query
    walks one root-to-leaf path, O(log n) nodes, and stops in each node's list at the first
    extent that misses). Building is O(n log n): the tree's depth is at most log2(n) + 1, its
    center at each node the median start. Chunks with no elements are left out; the other dims
    are checked on the chunks found, and the answer is in the order the tensor lists them."""

    __slots__ = ("starts", "start_pos", "nodes", "root", "log_n")

    def __init__(self, chunks: Sequence[ChunkRecord], work: IndexWork | None = None) -> None:
        work = work if work is not None else IndexWork()
        items = sorted(((c.offsets[0], c.offsets[0] + c.sizes[0], i) if c.sizes else (0, 1, i)
                        for i, c in enumerate(chunks) if c.numel), key=lambda x: x[0])
        self.starts = [s for s, _, _ in items]
        self.start_pos = [i for _, _, i in items]
        self.log_n = max(1, len(items).bit_length())
        # nodes[k] = [center, by_start [(start, pos)], by_end [(-end, pos)], left, right]
        self.nodes: list[list[Any]] = []
        self.root = self._build(items, work)

    def _build(self, items: list[tuple[int, int, int]], work: IndexWork) -> int:
        """The tree of ``items`` (sorted by start), built level by level; the root's number."""
        if not items:
            return -1
        todo: list[tuple[list[tuple[int, int, int]], int, int]] = [(items, -1, 0)]
        root = -1
        while todo:
            part, parent, side = todo.pop()
            work.built += len(part)
            center = part[len(part) // 2][0]
            left: list[tuple[int, int, int]] = []
            mid: list[tuple[int, int, int]] = []
            right: list[tuple[int, int, int]] = []
            for x in part:
                (left if x[1] <= center else right if x[0] > center else mid).append(x)
            k = len(self.nodes)
            self.nodes.append([center, [(s, i) for s, _, i in mid],
                               sorted(((-e, i) for _, e, i in mid), key=lambda y: y[0]), -1, -1])
            if parent < 0:
                root = k
            else:
                self.nodes[parent][3 + side] = k
            for sub, sd in ((left, 0), (right, 1)):
                if sub:
                    todo.append((sub, k, sd))
        return root

    def query(self, offsets: Sequence[int], sizes: Sequence[int],
              work: IndexWork | None = None) -> list[int]:
        """Positions, ascending, of the chunks with elements that meet the box's rows (its
        extent along dim 0; the other dims are not looked at). No rows, no chunks."""
        work = work if work is not None else IndexWork()
        if prod(sizes) == 0:
            return []
        lo, hi = (offsets[0], offsets[0] + sizes[0]) if sizes else (0, 1)
        found: list[int] = []
        k = self.root
        while k >= 0:  # the extents that hold row lo
            center, by_start, by_end, left, right = self.nodes[k]
            work.queried += 1
            if lo < center:
                for s, i in by_start:
                    work.queried += 1
                    if s > lo:
                        break
                    found.append(i)
                k = left
            else:
                for e, i in by_end:
                    work.queried += 1
                    if -e <= lo:
                        break
                    found.append(i)
                k = right
        a, b = bisect.bisect_right(self.starts, lo), bisect.bisect_left(self.starts, hi)
        work.queried += 2 * self.log_n + max(0, b - a)
        found += self.start_pos[a:b]  # the extents that start past lo, before hi
        found.sort()
        return found


def intersection(a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int],
                 b_size: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box two boxes share, or None if they share no element."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off, strict=True))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_size, b_off, b_size, strict=True))
    if any(y <= x for x, y in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(y - x for x, y in zip(lo, hi, strict=True))


def row_bands(offsets: Sequence[int], sizes: Sequence[int], elem: int,
              budget: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The box split along dim 0 into bands of at most ``budget`` bytes (at least one row)."""
    if not sizes:
        yield tuple(offsets), tuple(sizes)
        return
    row = prod(sizes[1:]) * elem
    step = max(1, budget // max(1, row))
    for r in range(0, sizes[0], step):
        n = min(step, sizes[0] - r)
        yield (offsets[0] + r, *offsets[1:]), (n, *sizes[1:])


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
