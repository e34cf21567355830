"""The chunk index of a chunked tensor: the readers (``read_rows``, ``iter_elements``, hence
import/export of DCP, consolidate and reshard) ask which chunks meet a band of rows, once per
band. The index is built once per tensor in O(n log n) steps and answers each band in
O(log n + k) for the k chunks it returns, with exactly the chunks, in the order, that comparing
the band with every chunk gives."""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import pytest

from shardckpt.checkpoint.chunked_read import iter_elements, iter_tensor_bands
from shardckpt.format import chunk_index, chunked
from shardckpt.format.chunk_index import row_bands
from shardckpt.format.chunk_tiling import overlap
from shardckpt.format.chunked import ChunkRecord, ChunkedTensor
from testing.tilings import split_tiling

#: 25k chunks: a scan per band is 6e8 steps here; the bounds are per chunk and per band
N = 25_000


def _tensor(shape: tuple[int, ...], boxes: Any, chunks_type: Any = tuple) -> ChunkedTensor:
    return ChunkedTensor("t", "float32", shape, chunks_type(
        ChunkRecord(tuple(o), tuple(s), "f", 0, 0) for o, s in boxes))


def _grid(rows: int, cols: int) -> list[Any]:
    return [((r, c), (1, 1)) for r in range(rows) for c in range(cols)]


def _strip_beside_rows(n: int) -> tuple[tuple[int, int], list[Any]]:
    """One chunk holding all of column 0 beside n one-row chunks of column 1: a scan of the
    chunks sorted by start, cut off by the furthest end before it, would walk every row."""
    return (n, 2), [((0, 0), (n, 1))] + [((i, 1), (1, 1)) for i in range(n)]


LARGE = {
    "rows": lambda: ((N, 8), [((i, 0), (1, 8)) for i in range(N)]),
    "grid 2-D": lambda: ((159, 159), _grid(159, 159)),
    "strip beside rows": lambda: _strip_beside_rows(N),
}


def _bands(shape: Sequence[int], budget: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes ``read_rows`` is asked for when a reader walks the whole tensor in bands of at
    most ``budget`` bytes (``iter_tensor_bands``; ``iter_elements`` asks for the same rows)."""
    return row_bands((0,) * len(shape), tuple(shape), 4, budget)


def _brute_force(t: ChunkedTensor, offsets: Sequence[int], sizes: Sequence[int]) -> list[ChunkRecord]:
    return [c for c in t.chunks if overlap(c.offsets, c.sizes, offsets, sizes)]


@pytest.mark.parametrize("budget", [1, 1 << 12], ids=["one row a band", "4 KiB bands"])
@pytest.mark.parametrize("layout", list(LARGE))
def test_every_band_of_many_chunks_costs_log_n_plus_its_chunks(layout: str, budget: int) -> None:
    shape, boxes = LARGE[layout]()
    t = _tensor(shape, boxes)
    n = len(t.chunks)
    assert n >= N
    work = chunk_index.IndexWork()
    bands = returned = 0
    for off, size in _bands(shape, budget):
        found = chunked.chunks_for(t, off, size, work)
        bands, returned = bands + 1, returned + len(found)
        # every chunk of these rows, and only those (spot-checked: the full check is quadratic)
        if bands % 9973 == 1:
            assert found == _brute_force(t, off, size)
    assert returned >= n  # the bands cover the tensor: each chunk comes back at least once
    assert work.built <= 20 * n, (work, n)
    bound = 20 * n + bands * 4 * (math.log2(n) + 2) + 2 * returned
    assert work.total <= bound, (work, n, bands, returned, bound)


def test_the_index_is_built_once_and_kept_on_the_record() -> None:
    shape, boxes = LARGE["rows"]()
    t = _tensor(shape, boxes)
    first = chunk_index.IndexWork()
    chunked.chunks_for(t, (5, 0), (3, 8), first)
    assert first.built >= len(boxes)
    again = chunk_index.IndexWork()
    assert [c.offsets for c in chunked.chunks_for(t, (7, 0), (2, 8), again)] == [(7, 0), (8, 0)]
    assert again.built == 0 and again.queried <= 4 * (math.log2(len(boxes)) + 2) + 4
    assert t.index() is t.index()
    # a cache, not part of the record: equality, repr and pickles leave it out
    copy = pickle.loads(pickle.dumps(t))
    assert copy == t and "_index" not in copy.__dict__ and "_index" not in repr(t)


class _CountedChunks(tuple):
    """A tensor's chunk list that counts how many chunks are looked at by walking it, and stops
    the walk past ``limit`` (so a reader that rescans it per band fails, rather than runs for
    hours)."""

    limit = 0
    seen = 0

    def __iter__(self) -> Iterator[Any]:
        for c in super().__iter__():
            type(self).seen += 1
            if type(self).seen > type(self).limit:
                raise AssertionError(f"the chunk list was walked past {type(self).limit} chunks")
            yield c


class _FileReader:
    """What ``read_box`` needs of a checkpoint reader: one file whose data section is ``data``."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        entry = SimpleNamespace(data_start=0)
        self.manifest = SimpleNamespace(file=lambda path: entry)

    def read_ranges(self, ranges: Sequence[Any]) -> list[memoryview]:
        return [memoryview(self.data)[a:b] for _, a, b in ranges]


@pytest.mark.parametrize("layout", ["rows", "grid 2-D"])
def test_reading_every_band_walks_the_chunk_list_once(layout: str) -> None:
    """``iter_tensor_bands`` / ``iter_elements`` one row at a time: the chunk list is walked once
    (to build the index), not once per band, and the bytes come out in order."""
    import numpy as np

    shape, boxes = LARGE[layout]()
    row = math.prod(shape[1:])
    # each chunk holds whole rows or one element, so it lies at its first element in the file
    records = [ChunkRecord(tuple(o), tuple(s), "f", 4 * (o[0] * row + o[1]),
                           4 * (o[0] * row + o[1] + math.prod(s))) for o, s in boxes]

    class Counted(_CountedChunks):
        limit, seen = 2 * len(records), 0

    t = ChunkedTensor("t", "float32", shape, Counted(records))
    data = np.arange(math.prod(shape), dtype=np.float32).tobytes()
    reader = _FileReader(data)
    got = b"".join(piece for _, piece in iter_tensor_bands(reader, t, 4 * row))
    assert got == data
    assert Counted.seen <= len(records)
    got = b"".join(iter_elements(reader, t, 3, len(data) // 4 - 5, 4 * row))
    assert got == data[12:-20]
    assert Counted.seen <= len(records)


# ---------------------------------------------------- the same answers as the full scan


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
@hypothesis.given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=4),
                  cuts=st.lists(st.integers(0, 60), max_size=16),
                  extra=st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=4, max_size=4),
                                           st.lists(st.integers(0, 6), min_size=4, max_size=4)),
                                 max_size=3),
                  order=st.randoms(use_true_random=False),
                  queries=st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=4, max_size=4),
                                             st.lists(st.integers(0, 6), min_size=4, max_size=4)),
                                   max_size=6),
                  budget=st.integers(1, 200))
def test_index_returns_what_the_full_scan_returns(shape: list[int], cuts: list[int], extra: Any,
                                                  order: Any, queries: Any, budget: int) -> None:
    """Small random tilings, shuffled, with a few stray boxes (overlapping, empty, or past the
    shape: the index answers for any boxes): every band a reader asks for, and random boxes."""
    shape_ = tuple(shape)
    nd = len(shape_)

    def clip(o: Sequence[int], s: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        o = tuple(min(x, d) for x, d in zip(o[:nd], shape_))
        return o, tuple(min(y, d - x + 1) for x, y, d in zip(o, s[:nd], shape_))

    boxes = split_tiling((0,) * nd, shape_, cuts) + [clip(o, s) for o, s in extra]
    order.shuffle(boxes)
    t = _tensor(shape_, boxes)
    asked = list(_bands(shape_, budget)) + [clip(o, s) for o, s in queries]
    for off, size in asked:
        assert list(chunked.chunks_for(t, off, size)) == _brute_force(t, off, size), (off, size)
