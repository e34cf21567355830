"""Object-store streams read through a sliding window (:mod:`shardckpt.storage.read_window`):
consolidate's reads do not wait at batch boundaries for a batch's slowest GET, the bytes held
stay within the budget (counted under the storage, not by the window), a chunk two batches share
is fetched once, and a read that fails, or a stream closed early, ends the threads (an error,
never a hang). On ``memory://``, which is read like an object store (ranged reads, no mapping)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest

from shardckpt.checkpoint.pieces import PieceReader, byte_ranges
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import RangeReader, Storage, windowed_reads
from shardckpt.tools.consolidate_plan import plan_consolidation
from shardckpt.tools.synth import synthesize

CS = 4096
FILES, FILE_CHUNKS = 3, 24
WAIT_S = 60  # only ends a test whose stream waits for a read that never comes (the old barrier)


def _window_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shardckpt-window")]


@pytest.fixture
def stored() -> tuple[Storage, list[FileEntry], list[bytes]]:
    storage = Storage(f"memory://read-window-{uuid.uuid4().hex}")
    entries, datas = [], []
    for k in range(FILES):
        data = np.random.default_rng(k).integers(0, 256, FILE_CHUNKS * CS, dtype=np.uint8).tobytes()
        with storage.writer(f"f{k}.bin", CS) as w:
            w.write(data)
            size, crc, chunks = w.close()
        entries.append(FileEntry(f"f{k}.bin", "shard", size, 0, crc, chunks, k))
        datas.append(data)
    return storage, entries, datas


def _counting(storage: Storage, delay: float = 0.0) -> list[tuple[str, int, int]]:
    """Record every ranged read the storage makes (file, start, end), each after ``delay``."""
    calls: list[tuple[str, int, int]] = []
    plain, lock = storage.read, threading.Lock()

    def read(rel: str, start: int | None = None, end: int | None = None) -> bytes:
        time.sleep(delay)  # a GET's latency: reads that may overlap do
        out = plain(rel, start, end)
        with lock:
            calls.append((rel, start or 0, (start or 0) + len(out)))
        return out
    storage.read = read  # type: ignore[method-assign]
    return calls


def test_the_bytes_held_stay_within_the_budget_counted_under_the_storage(stored: Any) -> None:
    storage, entries, datas = stored
    calls = _counting(storage, delay=0.002)
    # 24 batches of two whole chunks of two files, no chunk twice (fetched = requested)
    batches = [[(entries[b % FILES], (b // FILES) * CS, (b // FILES + 1) * CS),
                (entries[(b + 1) % FILES], (8 + b // FILES) * CS, (9 + b // FILES) * CS)]
               for b in range(24)]
    budget = 3 * 2 * CS
    consumed = 0
    ahead = 0
    for reqs, got in windowed_reads(RangeReader(storage, CS), ((r, r) for r in batches), budget, 8):
        assert [bytes(g) for g in got] == [datas[e.index][a:b] for e, a, b in reqs]  # type: ignore[index]
        fetched = sum(b - a for _, a, b in calls)
        held = fetched - consumed  # fetched and not yet let go: this batch and those read ahead
        assert held <= budget, (held, budget)
        ahead = max(ahead, held - 2 * CS)
        time.sleep(0.005)  # the caller's work: the window reads on meanwhile
        consumed += 2 * CS
    assert consumed == 48 * CS and ahead > 0  # it read ahead, and never beyond the budget
    assert not _window_threads()


def test_the_next_batch_is_read_during_a_slow_read_even_when_two_exceed_the_budget(stored: Any) -> None:
    """Batches larger than the budget: the one after the caller's still goes while a read of
    the caller's stalls (a window that waited for room would read them one at a time)."""
    storage, entries, datas = stored
    plain = storage.read
    released = threading.Event()
    stalled: list[bool] = []

    def read(rel: str, start: int | None = None, end: int | None = None) -> bytes:
        if rel == "f0.bin" and not stalled:
            stalled.append(released.wait(WAIT_S))
        elif rel == "f1.bin":
            released.set()
        return plain(rel, start, end)
    storage.read = read  # type: ignore[method-assign]
    batches = [[(entries[0], 0, 4 * CS)], [(entries[1], 0, 4 * CS)]]
    got = [bytes(g[0]) for _, g in windowed_reads(RangeReader(storage, CS), ((r, r) for r in batches),
                                                  5 * CS, 4)]
    assert stalled == [True]
    assert got == [datas[0][:4 * CS], datas[1][:4 * CS]]


def test_a_chunk_that_two_batches_share_is_fetched_once(stored: Any) -> None:
    """The end of one batch and the start of the next in one checksum chunk: the later read
    waits for the earlier and takes the chunk from the boundary cache (in flight together, both
    would fetch it)."""
    storage, entries, datas = stored
    calls = _counting(storage, delay=0.02)
    e = entries[0]
    cuts = [0, 3 * CS + 100, 5 * CS + 7, 9 * CS + 1, 12 * CS]
    batches = [[(e, a, b)] for a, b in zip(cuts, cuts[1:], strict=False)]
    ranges = RangeReader(storage, CS)
    got = [bytes(g[0]) for _, g in windowed_reads(ranges, ((r, r) for r in batches), 1 << 30, 8)]
    assert b"".join(got) == datas[0][:12 * CS]
    chunks = sorted(i for _, a, b in calls for i in range(a // CS, -(-b // CS)))
    assert chunks == list(range(12)), calls
    assert ranges.bytes_read == 12 * CS


def test_a_read_that_fails_ahead_fails_the_stream_when_reached_and_ends_the_threads(stored: Any) -> None:
    storage, entries, datas = stored
    plain = storage.read

    def read(rel: str, start: int | None = None, end: int | None = None) -> bytes:
        if rel == "f1.bin" and start == 6 * CS:
            raise RuntimeError("a reader thread died")
        return plain(rel, start, end)
    storage.read = read  # type: ignore[method-assign]
    batches = [[(entries[1], k * CS, (k + 1) * CS)] for k in range(12)]
    seen = []
    with pytest.raises(RuntimeError, match="died"):
        for _, got in windowed_reads(RangeReader(storage, CS), ((r, r) for r in batches), 1 << 30, 4):
            seen.append(bytes(got[0]))
    assert seen == [datas[1][k * CS:(k + 1) * CS] for k in range(6)]
    assert not _window_threads()

    stream = windowed_reads(RangeReader(storage, CS), ((r, r) for r in batches[:4]), 1 << 30, 4)
    next(stream)
    stream.close()  # closed early: queued reads cancelled, running ones waited for
    assert not _window_threads()


def test_consolidate_reads_past_the_slowest_read_of_a_batch() -> None:
    """Consolidate's pieces from an object store: while one GET of a batch stalls, reads of the
    next batch go on (read batch by batch, the next batch waited for this one: the stalled GET
    is released only after ``WAIT_S`` and the test fails)."""
    url = f"memory://read-window-ck-{uuid.uuid4().hex}"
    m = synthesize(url, 60_000, ranks=8, units=2, chunk_size=CS)
    reader = CheckpointReader(url)
    plan = plan_consolidation(m, "float32")
    items = [(t.numel, (t.source,)) for f in plan.files for t in f.tensors]
    engine = PieceReader([reader], buffer_bytes=4 * 8 * CS)  # batches of 8 chunks' worth
    batches = list(engine._batches(items))
    assert len(batches) >= 4

    def spans(batch: list[tuple[int, int, int]]) -> list[tuple[str, int, int]]:
        return [(e.path, a, b) for i, a, b in batch for e, a, b in byte_ranges(reader, items[i][1][0], a, b)]
    first, second = spans(batches[0]), set(spans(batches[1]))
    only_second = second - set(first)

    def overlaps(rel: str, a: int, b: int, ranges: Any) -> bool:
        return any(rel.endswith(p) and a < hi and lo < b for p, lo, hi in ranges)
    released = threading.Event()
    stalled: list[bool] = []
    plain = reader.files.read

    def read(rel: str, start: int | None = None, end: int | None = None) -> bytes:
        a, b = start or 0, end if end is not None else 1 << 62
        if not stalled and overlaps(rel, a, b, first[:1]):
            stalled.append(released.wait(WAIT_S))  # the batch's slowest GET
        elif overlaps(rel, a, b, only_second) and not overlaps(rel, a, b, first):
            released.set()
        return plain(rel, start, end)
    reader.files.read = read  # type: ignore[method-assign]
    got = b"".join(bytes(p.data[0]) for p in engine.pieces(items))
    assert stalled == [True], "the next batch's reads waited for the slowest read of this one"
    plain_reader = CheckpointReader(url)
    want = b"".join(bytes(plain_reader.files.read_checked(e, CS, a, b)) for n, (src,) in items
                    for e, a, b in byte_ranges(plain_reader, src, 0, n))
    assert got == want
