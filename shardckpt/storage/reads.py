"""The checked read path: byte ranges of files a manifest describes, each chunk CRC-checked.

A checked read fetches whole checksum chunks and verifies each against the manifest's CRC32C
(:func:`read_checked`); a chunk that fails is read once more before the read is declared corrupt
(a transfer can be bad where the object is not), and the error names the object and the bytes.

:class:`RangeReader` reads many ranges at once, in one of two ways:

* a **stream** (:meth:`RangeReader.fetch`: reshard, consolidate, diff): ranges read front to back.
  Where the backend can map files (local, POSIX) each range is a view of the mapped file, no copy,
  each chunk checked once (a bit per chunk remembers which were). Elsewhere consecutive ranges of
  a file that meet are coalesced into one read, and those reads, of every file of the batch, are
  in flight at once (:data:`REMOTE_READS_IN_FLIGHT` by default: on an object store a small ranged
  GET costs its latency, not its bytes, so a batch of many small slices is read in parallel, not
  file by file); a chunk two requests share (a boundary chunk) is kept until its rest has been
  read, so a stream of ranges reads each byte about once.
* **random access** (:meth:`RangeReader.gather`: checkpoint loads, DCP reads): ranges in any order,
  sorted per file, those whose chunks overlap or touch coalesced, spans read concurrently.

:func:`read_ahead` is the batch loop of a stream: it fetches batch ``k + 1`` on one background
thread while the caller uses batch ``k``. Consolidate from an object store reads its batches'
chains through :func:`~shardckpt.storage.read_window.windowed_reads` instead: in flight across
batch boundaries, no batch waiting for the previous one's slowest read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from collections.abc import Callable, Iterable, Iterator, Sequence

from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage.checked import Files, map_chunks, read_checked, read_chunks
from shardckpt.storage.s3copy import MIN_COPY, copy_source_for, sourced

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")
Request = tuple[FileEntry, int, int]  # a file and an absolute byte range [start, end) of it
#: Runs of one file read one after the other: (entry, lo, hi, indices of the requests in [lo, hi)).
Chain = list[tuple[FileEntry, int, int, list[int]]]

#: Default ``buffer_bytes`` of the tools that read pieces of tensors (consolidate, diff): a
#: quarter of it per batch, so that it bounds the batch in use, those read ahead (one; two from an
#: object store, :mod:`.read_window`) and the cache.
DEFAULT_BUFFER = 64 << 20
#: Default ``buffer_bytes`` of reshard and the importers: the bytes of one read batch (two are held
#: at once).
DEFAULT_BATCH = 32 << 20
#: Reads in flight for one stream batch where the storage does not map files (object stores,
#: ``memory://``): each read is one coalesced run of chunks; a run larger than the backend's
#: ``range_piece`` is itself split into concurrent ranged GETs.
REMOTE_READS_IN_FLIGHT = 16


_END: Any = object()


def read_ahead(items: Iterable[ItemT], fetch: Callable[[ItemT], ResultT],
               name: str = "shardckpt-readahead") -> Iterator[tuple[ItemT, ResultT]]:
    """``(item, fetch(item))`` in order; once ``item`` is fetched, the next one is fetched on one
    background thread while the caller uses it. At most two results are held: the one in use
    and the next. Close the iterator (or exhaust it) to end the thread."""
    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        it = iter(items)
        item = next(it, _END)
        job = None if item is _END else pool.submit(fetch, item)
        while job is not None:
            data = job.result()
            current, item = item, next(it, _END)
            job = None if item is _END else pool.submit(fetch, item)
            yield current, data
            del data  # the caller is done with it: hold only the next one


def pool_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> None:
    """``fn(item)`` for each item, on up to ``workers`` threads (in this thread for one item)."""
    if len(items) <= 1 or workers <= 1:
        for it in items:
            fn(it)
    else:
        with ThreadPoolExecutor(min(workers, len(items))) as pool:
            list(pool.map(fn, items))


class RangeReader:
    """Checked reads of many byte ranges of one checkpoint's files (module doc).

    ``prefix`` is prepended to every entry's path. ``capacity``: the most boundary chunks the
    stream keeps. ``bytes_read`` counts what was fetched from storage (mapped: each chunk the
    first time it is checked). Thread-safe, except :meth:`map_many` (one caller at a time).
    """

    def __init__(self, storage: Files, chunk_size: int, capacity: int = 64, prefix: str = "") -> None:
        self.storage, self.chunk_size, self.capacity, self.prefix = storage, chunk_size, capacity, prefix
        self._cache: OrderedDict[tuple[str, int], tuple[bytes, int]] = OrderedDict()  # data, consumed
        self._lock = threading.Lock()
        self._checked: dict[str, bytearray] = {}  # map_many: a bit per chunk already checked
        self._etags: dict[str, str | None] = {}  # sourced: the ETag of each object, one HEAD each
        self.bytes_read = 0

    @property
    def maps(self) -> bool:
        """Whether :meth:`fetch` maps files here instead of reading them."""
        return bool(self.storage.backend.can_map)

    def fetch(self, requests: Sequence[Request], workers: int | None = None) -> list[bytes | memoryview]:
        """A stream's batch: :meth:`map_many` where the backend maps files, else :meth:`read_many`
        (``workers`` reads in flight, :data:`REMOTE_READS_IN_FLIGHT` unless given)."""
        if self.maps:
            return self.map_many(requests)  # type: ignore[return-value]
        return self.read_many(requests, workers)

    def sourced(self, request: Request, data: Any) -> Any:
        """``data`` (the checked bytes of ``request``) marked with where they came from, so that a
        writer on the same object store may have the server copy them instead of uploading them
        (:mod:`.s3copy`); as it is where that cannot apply (small ranges, mapped files)."""
        entry, a, b = request
        if b - a < MIN_COPY or self.maps:
            return data
        return sourced(data, copy_source_for(self.storage, self.prefix + entry.path, a, b, self._etags))

    def _outside(self, entry: FileEntry, start: int, end: int) -> IntegrityError:
        return IntegrityError(f"{self.storage.url_of(self.prefix + entry.path)}: range [{start}, "
                              f"{end}) is outside its {entry.size} bytes")

    # ----------------------------------------------------------------- random access

    def gather(self, requests: Sequence[Request], workers: int = 8) -> list[memoryview]:
        """Each range, checked; per file sorted, ranges whose chunks overlap or touch read as one
        span, spans read concurrently on up to ``workers`` threads. No cache."""
        cs = self.chunk_size
        by_file: dict[str, list[int]] = {}
        for i, (e, _, _) in enumerate(requests):
            by_file.setdefault(e.path, []).append(i)
        spans: list[tuple[FileEntry, int, int, list[int]]] = []
        for idx in by_file.values():
            idx.sort(key=lambda i: requests[i][1])
            cur: list[int] = []
            lo = hi = 0
            for i in idx:
                e, a, b = requests[i]
                ca, cb = a // cs * cs, -(-b // cs) * cs
                if cur and ca <= hi:
                    hi = max(hi, cb)
                    cur.append(i)
                else:
                    if cur:
                        spans.append((requests[cur[0]][0], lo, min(hi, requests[cur[0]][0].size), cur))
                    cur, lo, hi = [i], ca, cb
            if cur:
                spans.append((requests[cur[0]][0], lo, min(hi, requests[cur[0]][0].size), cur))
        out: list[memoryview | None] = [None] * len(requests)

        def span(sp: tuple[FileEntry, int, int, list[int]]) -> None:
            e, lo, hi, members = sp
            view = read_checked(self.storage, e, cs, lo, hi, self.prefix)
            for i in members:
                _, a, b = requests[i]
                out[i] = view[a - lo:b - lo]

        pool_map(span, spans, workers)
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------- stream: boundary cache

    def _overlap(self, i: int, start: int, end: int) -> int:
        return max(0, min(end, (i + 1) * self.chunk_size) - max(start, i * self.chunk_size))

    def _used(self, entry: FileEntry, i: int, start: int, end: int) -> int:
        """Bytes of chunk ``i`` consumed once ``[start, end)`` is: the range's part, plus the
        file's header (never requested through this reader, so it must not keep a chunk alive)."""
        return self._overlap(i, start, end) + self._overlap(i, 0, min(entry.data_start, start))

    def _take(self, key: tuple[str, int], start: int, end: int) -> bytes | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            data, used = hit
            used += self._overlap(key[1], start, end)
            if used >= len(data):
                del self._cache[key]  # every byte of it has been consumed
            else:
                self._cache[key] = (data, used)
                self._cache.move_to_end(key)
            return data

    def _put(self, key: tuple[str, int], data: bytes, used: int) -> None:
        with self._lock:
            self._cache[key] = (data, used)
            self._cache.move_to_end(key)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)

    def read(self, entry: FileEntry, start: int, end: int) -> bytes | memoryview:
        """Bytes ``[start, end)`` of ``entry``, checked, through the boundary-chunk cache: a chunk
        is kept while partly consumed (with the bytes consumed so far) and dropped once later
        reads have consumed the rest (or, least recently used, beyond ``capacity``)."""
        cs = self.chunk_size
        if not 0 <= start <= end <= entry.size:
            raise self._outside(entry, start, end)
        if start == end:
            return b""
        c0, c1 = start // cs, -(-end // cs)
        chunks: list[bytes | memoryview | None] = [self._take((entry.path, i), start, end)
                                                   for i in range(c0, c1)]
        lo = next((k for k, c in enumerate(chunks) if c is None), None)
        if lo is not None:
            hi = max(k for k, c in enumerate(chunks) if c is None) + 1
            view = read_chunks(self.storage, entry, cs, c0 + lo, c0 + hi, self.prefix)
            with self._lock:
                self.bytes_read += len(view)
            for k in range(lo, hi):
                if chunks[k] is None:
                    chunks[k] = view[(k - lo) * cs:(k - lo + 1) * cs]
            for k in {lo, hi - 1}:
                i = c0 + k
                used = self._used(entry, i, start, end)
                if used < min(entry.size, (i + 1) * cs) - i * cs:  # partly consumed: keep it
                    self._put((entry.path, i), bytes(view[(k - lo) * cs:(k - lo + 1) * cs]), used)
            if lo == 0 and hi == len(chunks):  # all fetched in one piece: no copy
                return view[start - c0 * cs:end - c0 * cs]
        if len(chunks) == 1:
            return bytes(memoryview(chunks[0])[start - c0 * cs:end - c0 * cs])  # type: ignore[arg-type]
        joined = b"".join(chunks)  # type: ignore[arg-type]
        return memoryview(joined)[start - c0 * cs:end - c0 * cs]

    @staticmethod
    def _runs(requests: Sequence[Request]) -> list[list[tuple[FileEntry, int, int, list[int]]]]:
        """Per file (in order of first appearance), runs of consecutive requests that meet (the
        next starts where the previous ended): ``(entry, lo, hi, request indices)``."""
        by_file: dict[str, list[int]] = {}
        for i, (e, _, _) in enumerate(requests):
            by_file.setdefault(e.path, []).append(i)
        out = []
        for indices in by_file.values():
            runs, k = [], 0
            while k < len(indices):
                entry, lo, hi = requests[indices[k]]
                end = k + 1
                while end < len(indices) and requests[indices[end]][1] == hi:
                    hi = requests[indices[end]][2]
                    end += 1
                runs.append((entry, lo, hi, indices[k:end]))
                k = end
            out.append(runs)
        return out

    def read_many(self, requests: Sequence[Request], workers: int | None = None) -> list[bytes | memoryview]:
        """Each range through :meth:`read`; consecutive requests of a file that meet coalesced
        into one read (one ranged GET for a stream of adjacent slices), and those reads, of all
        files, on up to ``workers`` threads (:data:`REMOTE_READS_IN_FLIGHT` unless given); two
        reads of one file that share a boundary chunk go one after the other on one thread
        (:meth:`_chains`), so that the chunk is fetched and checked once."""
        out: list[bytes | memoryview] = [b""] * len(requests)
        pool_map(lambda chain: self.read_chain(requests, chain, out), self.chains(requests),
                 REMOTE_READS_IN_FLIGHT if workers is None else workers)
        return out

    def chains(self, requests: Sequence[Request]) -> list[Chain]:
        """The reads of :meth:`read_many`: per file, runs of requests that meet, grouped into
        chains of runs that share a checksum chunk (read in order, on one thread)."""
        return [c for file_runs in self._runs(requests) for c in self._chains(file_runs)]

    def read_chain(self, requests: Sequence[Request], chain: Chain,
                   out: list[bytes | memoryview]) -> None:
        """Read ``chain`` (of :meth:`chains`), its runs in order (a shared chunk is fetched once),
        each request's bytes into ``out`` at its index."""
        for entry, lo, hi, members in chain:
            view = memoryview(self.read(entry, lo, hi))
            for i in members:
                _, a, b = requests[i]
                out[i] = view[a - lo:b - lo]

    def _chains(self, runs: list[tuple[FileEntry, int, int, list[int]]]) -> list[Chain]:
        """One file's runs, cut where two neighbours share no checksum chunk: the runs of a chain
        are read in order (the boundary chunk they share is fetched once and kept for the next),
        the chains at once."""
        cs = self.chunk_size
        chains: list[Chain] = []
        for run in runs:
            if chains and run[1] // cs <= (chains[-1][-1][2] - 1) // cs:
                chains[-1].append(run)
            else:
                chains.append([run])
        return chains

    # ------------------------------------------------------------------ stream: mapped

    def map_many(self, requests: Sequence[Request]) -> list[memoryview]:
        """Where the backend maps files: each range as a read-only view of its mapped file (no
        copy; one mapping per file and call), every chunk under a range CRC-checked once per
        reader, so ranges that share a chunk check it once. Views pin their mapping: drop them
        when done."""
        cs = self.chunk_size
        out: list[memoryview] = [memoryview(b"")] * len(requests)
        by_file: dict[str, list[int]] = {}
        for k, (entry, start, end) in enumerate(requests):
            if not 0 <= start <= end <= entry.size:
                raise self._outside(entry, start, end)
            if start < end:
                by_file.setdefault(entry.path, []).append(k)
        for members in by_file.values():
            entry = requests[members[0]][0]
            ranges = [(requests[k][1], requests[k][2]) for k in members]
            c0 = min(a for a, _ in ranges) // cs
            c1 = -(-max(b for _, b in ranges) // cs)
            checked = self._checked.get(entry.path)
            if checked is None:
                checked = self._checked[entry.path] = bytearray(-(-entry.size // cs) // 8 + 1)
            view, fresh = map_chunks(self.storage, entry, cs, c0, c1, self.prefix, checked, ranges)
            with self._lock:
                self.bytes_read += fresh
            for k, (a, b) in zip(members, ranges, strict=True):
                out[k] = view[a - c0 * cs:b - c0 * cs]
        return out
