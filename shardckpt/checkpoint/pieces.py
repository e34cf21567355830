"""Pieces of tensors read from checkpoints, and the dtype casts applied to them. No torch.

Shared by :mod:`shardckpt.tools.consolidate` (one reader, cast and written out) and :mod:`shardckpt.tools.diff`
(two readers, compared). A :class:`Source` says where a tensor's elements lie in one checkpoint;
a :class:`PieceReader` yields aligned pieces of many tensors, in bounded memory; the casts are
pure numpy on little-endian bytes (bf16 is round-to-nearest-even, bit-identical to torch's CPU
cast, NaN included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple
from collections.abc import Iterator, Sequence

import numpy as np

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import ConfigError, ManifestError
from shardckpt.format.dtypes import NUMPY, itemsize
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import (
    DEFAULT_BUFFER, REMOTE_READS_IN_FLIGHT, RangeReader, Request, read_ahead, windowed_reads,
)


# ----------------------------------------------------------------------------- dtype casts (pure)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 ``x``: round to nearest, ties to even.

    Adds ``0x7FFF + lsb`` to the uint32 pattern and keeps the high half; infinities stay
    infinities, overflow rounds to infinity, subnormals round like normals. Every NaN becomes
    ``0xFFFF``, what torch's CPU cast gives.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    t = u >> np.uint32(16)
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    t += u  # wraps only for NaNs with the sign bit set; those are replaced below
    t >>= np.uint32(16)
    out = t.astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = np.uint16(0xFFFF)
    return out


def _fp8_table(dtype: str) -> np.ndarray:
    """The 256 float32 values of an fp8 format (e4m3fn: no infinities; e5m2: IEEE-like)."""
    exp_bits, man_bits, bias = (4, 3, 7) if dtype == "float8_e4m3fn" else (5, 2, 15)
    code = np.arange(256)
    e, m = (code >> man_bits) & ((1 << exp_bits) - 1), code & ((1 << man_bits) - 1)
    frac = m / (1 << man_bits)
    val = np.where(e == 0, np.ldexp(frac, 1 - bias), np.ldexp(1 + frac, e - bias))
    if dtype == "float8_e5m2":
        val = np.where(e == 31, np.where(m == 0, np.inf, np.nan), val)
    else:
        val = np.where((e == 15) & (m == 7), np.nan, val)
    return np.where(code & 0x80, -val, val).astype(np.float32)


def decode(raw: Any, dtype: str) -> np.ndarray:
    """Little-endian bytes of ``dtype`` as a numpy array (bf16 and fp8 widened to float32)."""
    if dtype == "bfloat16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype.startswith("float8"):
        return _fp8_table(dtype)[np.frombuffer(raw, np.uint8)]
    return np.frombuffer(raw, NUMPY[dtype])


def cast_bytes(raw: Any, src: str, dst: str) -> Any:
    """Bytes of ``raw`` (``src``) cast to ``dst``; identity when they are equal."""
    if src == dst:
        return raw
    x = decode(raw, src)
    if dst == "bfloat16":
        return f32_to_bf16_bits(x.astype(np.float32, copy=False))
    if x.dtype == np.float64 and dst != "float64":
        x = x.astype(np.float32)  # double -> float -> half, as torch does
    with np.errstate(over="ignore"):  # out of range -> inf, as torch casts
        return x.astype(NUMPY[dst])


# ------------------------------------------------------------------------- piece reads (effectful)


@dataclass(frozen=True, slots=True)
class Source:
    """Where a tensor's elements lie: state ``kind`` of flat ``group`` from element ``offset``,
    or (``group`` None) the buffer ``fqn``."""

    dtype: str
    group: str | None
    kind: str
    offset: int
    fqn: str


def byte_ranges(reader: CheckpointReader, src: Source, start: int, end: int,
                check: bool = True) -> list[tuple[FileEntry, int, int]]:
    """Absolute byte ranges (one per shard file touched) of elements ``[start, end)`` of ``src``;
    each file's header checked first (:meth:`~CheckpointReader.check_file`) unless ``check`` is
    false (the caller checks them)."""
    if src.group is None:
        entry = reader.manifest.buffers_file()
        slot = reader.buffer_slots.get(src.fqn)
        if entry is None or slot is None:
            raise ManifestError(f"{reader.url}: no buffer {src.fqn!r}")
        if check:
            reader.check_file(entry)
        n, base = itemsize(src.dtype), entry.data_start + slot.begin
        return [(entry, base + start * n, base + end * n)]
    s = reader.slot(src.group, src.kind).shape[0]
    x, stop = src.offset + start, src.offset + end
    out = []
    while x < stop:
        shard = x // s
        hi = min(stop, (shard + 1) * s)
        out.append(reader.state_range(shard, src.group, src.kind, x - shard * s, hi - shard * s, check))
        x = hi
    return out


#: Most bytes of boundary chunks a PieceReader keeps per checkpoint (see ``_cache_capacity``).
MAX_CACHE_BYTES = 256 << 20
#: Batches an object-store PieceReader holds at once: the one in use and up to two read ahead
#: (its reads in flight across batch boundaries: :func:`~shardckpt.storage.windowed_reads`).
WINDOW_BATCHES = 3


def _cache_capacity(reader: CheckpointReader, batch_bytes: int) -> int:
    """Chunks to cache: one partly consumed chunk per shard file (consecutive pieces of a tensor
    run through every shard, and each file is read front to back, so every file has a chunk whose
    rest the next batch takes), plus the batches' worth held at once; at most :data:`MAX_CACHE_BYTES`."""
    cs = reader.manifest.chunk_size
    want = max(2, WINDOW_BATCHES * batch_bytes // cs) + len(reader.manifest.files) + 2
    return max(2, min(want, MAX_CACHE_BYTES // cs))


class Piece(NamedTuple):
    index: int  # type: ignore[assignment]  # which item; a NamedTuple field may shadow tuple.index, which mypy reads as an override
    start: int               # element range [start, end) inside the item's tensor
    end: int
    data: tuple[bytes | memoryview, ...]  # one per reader (views where the storage maps files)


class PieceReader:
    """Reads aligned pieces of tensors from one or more checkpoints, in batches.

    ``pieces(items)`` yields, for item ``i = (numel, sources)`` with one source per reader, the
    pieces ``[a, b)`` that tile ``[0, numel)`` in order, with the same boundaries on every reader.
    A batch holds at most ``buffer_bytes / 4`` source bytes; one batch is read ahead while the
    caller consumes the previous one (one object-store reader: up to two, their reads in flight
    across batches, :data:`WINDOW_BATCHES`), and boundary chunks shared by consecutive ranges are cached
    (one per source file, up to :data:`MAX_CACHE_BYTES`), so memory is about ``buffer_bytes`` plus
    a chunk per source file, whatever the tensor sizes.
    """

    def __init__(self, readers: Sequence[CheckpointReader], buffer_bytes: int = DEFAULT_BUFFER,
                 workers: int | None = None) -> None:
        if buffer_bytes < 1:
            raise ConfigError(f"buffer of {buffer_bytes} bytes; it must be positive")
        self.readers = list(readers)
        self.batch_bytes = max(1, buffer_bytes // 4)
        self.ranges = [RangeReader(r.files, r.manifest.chunk_size,
                                   capacity=_cache_capacity(r, self.batch_bytes))
                       for r in self.readers]
        self.workers = workers

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranges)

    def _batches(self, items: Sequence[tuple[int, Sequence[Source]]]) -> Iterator[list[tuple[int, int, int]]]:
        batch: list[tuple[int, int, int]] = []
        size = 0
        for i, (numel, sources) in enumerate(items):
            per_elem = sum(itemsize(s.dtype) for s in sources)
            step = max(1, self.batch_bytes // per_elem)
            for a in range(0, numel, step):
                b = min(numel, a + step)
                batch.append((i, a, b))
                size += (b - a) * per_elem
                if size >= self.batch_bytes:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch

    def _requests(self, items: Sequence[tuple[int, Sequence[Source]]], batch: list[tuple[int, int, int]],
                  side: int, check: bool = True) -> tuple[list[Request], list[int]]:
        """The byte ranges of ``batch`` on reader ``side``, and the batch entry each belongs to."""
        requests, owner = [], []
        for k, (i, a, b) in enumerate(batch):
            for r in byte_ranges(self.readers[side], items[i][1][side], a, b, check):
                requests.append(r)
                owner.append(k)
        return requests, owner

    @staticmethod
    def _joined(n: int, owner: list[int], got: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
        parts: list[list[bytes | memoryview]] = [[] for _ in range(n)]
        for k, data in zip(owner, got, strict=True):
            parts[k].append(data)
        return [p[0] if len(p) == 1 else b"".join(p) for p in parts]

    def _read(self, items: Sequence[tuple[int, Sequence[Source]]], batch: list[tuple[int, int, int]]) -> list[Piece]:
        sides = []
        for side, ranges in enumerate(self.ranges):
            requests, owner = self._requests(items, batch, side)
            got = ranges.fetch(requests, self.workers)  # mapped where the storage maps files
            sides.append(self._joined(len(batch), owner, got))
        return [Piece(i, a, b, tuple(s[k] for s in sides)) for k, (i, a, b) in enumerate(batch)]

    def _windowed(self, items: Sequence[tuple[int, Sequence[Source]]]) -> Iterator[Piece]:
        """One object-store reader: the batches' reads through one sliding window of
        :data:`WINDOW_BATCHES` batches (:func:`~shardckpt.storage.windowed_reads`), no barrier
        between batches."""
        planned = []
        for batch in self._batches(items):
            requests, owner = self._requests(items, batch, 0, check=False)
            planned.append(((batch, owner), requests))
        # every file's header at once, before the first batch: checked one by one as the batches
        # were planned, a 64-rank checkpoint's headers were 64 GETs in a row
        self.readers[0].check_files((r[0] for _, requests in planned for r in requests),
                                    self.workers or REMOTE_READS_IN_FLIGHT)
        stream = windowed_reads(self.ranges[0], planned, WINDOW_BATCHES * self.batch_bytes, self.workers)
        try:
            for (batch, owner), got in stream:
                data = self._joined(len(batch), owner, got)
                yield from (Piece(i, a, b, (data[k],)) for k, (i, a, b) in enumerate(batch))
                del got, data  # before the next batch is waited for
        finally:
            stream.close()  # type: ignore[attr-defined]

    def pieces(self, items: Sequence[tuple[int, Sequence[Source]]]) -> Iterator[Piece]:
        if len(self.ranges) == 1 and not self.ranges[0].maps:
            yield from self._windowed(items)
            return
        batches = read_ahead(self._batches(items), lambda batch: self._read(items, batch))
        try:
            for _, got in batches:
                yield from got
                del got  # before the next batch is waited for: two batches at most
        finally:
            batches.close()  # type: ignore[attr-defined]
