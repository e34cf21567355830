"""Whether the boxes of a chunked tensor tile it: every box inside the shape, no two sharing an
element, every element in one (:func:`tiling_problems`, which :func:`shardckpt.format.chunked.parse_section`
asks of every tensor). Pure; no torch.

Work O(n log n + n 2^d) for ``n`` boxes splitting ``d`` dimensions, so that a manifest of a
million chunks is checked in seconds: an exact-cover test by corner counts, and a sweep that
names the boxes that overlap.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from collections.abc import Iterator, Sequence

from shardckpt.format.layout import prod
from shardckpt.format.parse_context import MAX_LISTED


class Box(Protocol):
    """An N-D box of a tensor (a :class:`~shardckpt.format.chunked.ChunkRecord`)."""

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def sizes(self) -> tuple[int, ...]: ...

    @property
    def numel(self) -> int: ...


class Boxed(Protocol):
    """A tensor stored as boxes (a :class:`~shardckpt.format.chunked.ChunkedTensor`)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def numel(self) -> int: ...

    @property
    def chunks(self) -> Sequence[Box]: ...


B = TypeVar("B", bound=Box)


def _box(c: Box) -> str:
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


def tiling_problems(t: Boxed, work: TilingWork | None = None) -> list[str]:
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


def _exact_cover(shape: Sequence[int], live: Sequence[Box], dims: Sequence[int],
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


def _overlapping_pairs(live: Sequence[B], dims: Sequence[int], work: TilingWork
                       ) -> tuple[list[tuple[B, B]], bool]:
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
    out: list[tuple[B, B]] = []

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
