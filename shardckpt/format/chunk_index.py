"""Which stored boxes of a chunked tensor meet a box: the index the readers' queries (a band of
rows, a chunk of another tensor; :func:`shardckpt.format.chunked.chunks_for`) go through, a
:class:`ChunkIndex` built once per tensor, and the box arithmetic around them (two boxes'
intersection, bands of rows). Pure; no torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Sequence

from shardckpt.format.chunk_tiling import Box
from shardckpt.format.layout import prod


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

    def __init__(self, chunks: Sequence[Box], work: IndexWork | None = None) -> None:
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
