"""Checked reads through a small ring of host buffers, several in flight, and the worker threads
that run them (and the parallel positioned writes of :mod:`shardckpt.storage.pwrite`).

A load names, per file, the byte ranges it wants and where each goes (``pieces``: ``(start, end,
target)``). The chunks those ranges touch are cut into *windows* of whole chunks, at most one
ring buffer long (a buffer holds at least one chunk). Each of ``threads`` workers takes the next
window, waits for a free buffer of the ring (``buffers`` of them, allocated on first use, so a
small load allocates little), reads the window into it with positioned reads, checks the
CRC32C of every chunk in it (the ``crc32c`` extension releases the GIL, so the checks of
several windows run at once), then hands each piece's part of the window to ``put(target, at,
slot, lo, hi)``: bytes ``slot.view[lo:hi]`` are bytes ``[at, at + hi - lo)`` of that piece.
``put`` may start an asynchronous copy (a device copy on a side stream) and set ``slot.wait``:
the slot is not refilled before ``wait()`` returns. Nothing bigger than the ring is held: the
host memory of a load is ``buffers * buffer_bytes`` whatever the checkpoint's size.

The first error of any worker stops the others (each checks between windows, and no worker
waits for a buffer once a failure is set) and is raised by :func:`run_workers` in the caller's
thread: a worker that dies ends the load in an error, never in a hang.

Knobs (:meth:`IOConfig.from_env`): ``SHARDCKPT_IO_BUFFERS`` (ring buffers, default 8),
``SHARDCKPT_IO_BUFFER_SIZE`` (bytes per buffer, ``16M`` by default; rounded down to whole
chunks, at least one), ``SHARDCKPT_IO_THREADS`` (workers, default 8: as many reads or writes
in flight as the disk's parallel limit is measured with) and ``SHARDCKPT_IO_PIPELINE`` (``1``:
loads into CPU tensors that have a plain path of their own, the node-local tier's direct read and
DCP's storage reader, take the pipeline too; tensors on a device always do).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shardckpt.errors import ConfigError, IntegrityError
from shardckpt.format.integrity import crc32c
from shardckpt.format.manifest import FileEntry
from shardckpt.format.quantities import parse_size
from shardckpt.storage.local import pread_full

T = TypeVar("T")
ENV_BUFFERS, ENV_BUFFER_SIZE, ENV_THREADS = ("SHARDCKPT_IO_BUFFERS", "SHARDCKPT_IO_BUFFER_SIZE",
                                             "SHARDCKPT_IO_THREADS")
ENV_PIPELINE = "SHARDCKPT_IO_PIPELINE"


@dataclass(frozen=True)
class IOConfig:
    """How much host memory and how many threads one rank's pipelined load or save uses."""

    buffers: int = 8
    buffer_bytes: int = 16 << 20
    threads: int = 8
    every_device: bool = False  # CPU destinations too, where they have a plain path

    def __post_init__(self) -> None:
        for name in ("buffers", "buffer_bytes", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"IOConfig.{name}: {v!r}; expected an integer >= 1")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> IOConfig:
        env = os.environ if environ is None else environ
        d = cls()

        def count(key: str, default: int) -> int:
            text = env.get(key, "").strip()
            if not text:
                return default
            if not text.isdigit() or int(text) < 1:
                raise ConfigError(f"{key}={text!r}: expected an integer >= 1")
            return int(text)

        size = env.get(ENV_BUFFER_SIZE, "").strip()
        every = env.get(ENV_PIPELINE, "").strip()
        if every not in ("", "0", "1"):
            raise ConfigError(f"{ENV_PIPELINE}={every!r}: expected 0 or 1")
        return cls(count(ENV_BUFFERS, d.buffers),
                   parse_size(size, ENV_BUFFER_SIZE) if size else d.buffer_bytes,
                   count(ENV_THREADS, d.threads), every == "1")

    def slot_bytes(self, chunk_size: int) -> int:
        """Bytes of one ring buffer for chunks of ``chunk_size``: whole chunks, at least one."""
        return max(1, self.buffer_bytes // chunk_size) * chunk_size


@dataclass(eq=False)
class Slot:
    """One ring buffer: ``view`` (writable bytes), ``handle`` (what the allocator returned, e.g.
    a pinned tensor sharing that memory) and ``wait`` (called before the slot is refilled)."""

    view: memoryview
    handle: Any
    wait: Callable[[], None] | None = None


class Aborted(Exception):
    """A worker stopped because another one failed (never raised to the caller)."""


class Ring:
    """At most ``n`` slots of ``nbytes`` each, allocated by ``alloc(nbytes) -> (view, handle)``
    on first need; :meth:`acquire` blocks while all are in use, and gives up once ``abort`` is set."""

    def __init__(self, n: int, nbytes: int, alloc: Callable[[int], tuple[memoryview, Any]]) -> None:
        self.n, self.nbytes, self.alloc = n, nbytes, alloc
        self.free: list[Slot] = []
        self.made = 0
        self.cond = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        return self.made * self.nbytes

    def acquire(self, abort: threading.Event) -> Slot:
        with self.cond:
            while not self.free and self.made >= self.n:
                if abort.is_set():
                    raise Aborted
                self.cond.wait(0.05)
            if abort.is_set():
                raise Aborted
            if self.free:
                slot = self.free.pop()
            else:
                self.made += 1
                slot = None
        if slot is None:
            try:
                view, handle = self.alloc(self.nbytes)
            except BaseException:
                with self.cond:
                    self.made -= 1
                    self.cond.notify()
                raise
            slot = Slot(view, handle)
        if slot.wait is not None:  # the previous use's asynchronous copy out of it
            slot.wait()
            slot.wait = None
        return slot

    def release(self, slot: Slot) -> None:
        with self.cond:
            self.free.append(slot)
            self.cond.notify()

    def drain(self) -> None:
        """Wait for every slot's pending copy (the end of a pipeline)."""
        for slot in self.free:
            if slot.wait is not None:
                slot.wait()
                slot.wait = None


def run_workers(items: Iterable[T], fn: Callable[[T, threading.Event], None], threads: int,
                name: str) -> None:
    """``fn(item, abort)`` for every item on ``threads`` threads; the first error stops the rest
    (``abort`` is set; items not started are skipped) and is raised here once all have ended."""
    it, lock = iter(items), threading.Lock()
    abort, errors = threading.Event(), []
    end = object()

    def loop() -> None:
        try:
            while not abort.is_set():
                with lock:
                    item = next(it, end)
                if item is end:
                    return
                fn(item, abort)  # type: ignore[arg-type]
        except Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            with lock:
                errors.append(e)
            abort.set()

    workers = [threading.Thread(target=loop, name=f"shardckpt-{name}-{i}", daemon=True)
               for i in range(max(1, threads))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------- reads


Reader = Callable[[memoryview, int], None]   # fill the view with the file's bytes from offset


@dataclass
class FileReads:
    """What a load wants of one file: ``pieces`` ((start, end, target), any order, may overlap)
    and ``read`` (positioned reads of it); ``url`` names it in errors."""

    entry: FileEntry
    url: str
    read: Reader
    pieces: list[tuple[int, int, Any]] = field(default_factory=list)


def windows(size: int, chunk_size: int, pieces: Sequence[tuple[int, int, Any]],
            per_window: int) -> list[tuple[int, int, list[tuple[Any, int, int, int]]]]:
    """``(w0, w1, parts)`` for every window of at most ``per_window`` whole chunks of the chunks
    ``pieces`` touch, in file order; each part ``(target, at, lo, hi)``: window bytes ``[lo,
    hi)`` are bytes ``[at, ...)`` of that piece. Pure."""
    cs = chunk_size
    touched = sorted({c for a, b, _ in pieces if b > a for c in range(a // cs, -(-b // cs))})
    out: list[tuple[int, int, list[tuple[Any, int, int, int]]]] = []
    i = 0
    while i < len(touched):
        j = i + 1
        while j < len(touched) and touched[j] == touched[j - 1] + 1 and j - i < per_window:
            j += 1
        w0, w1 = touched[i] * cs, min(size, (touched[j - 1] + 1) * cs)
        parts = [(t, max(a, w0) - a, max(a, w0) - w0, min(b, w1) - w0)
                 for a, b, t in pieces if a < w1 and b > w0]
        out.append((w0, w1, parts))
        i = j
    return out


def check_chunks(entry: FileEntry, chunk_size: int, url: str, w0: int, view: memoryview) -> None:
    """The CRC32C of every whole chunk in ``view`` (file bytes from ``w0``, chunk-aligned)."""
    cs = chunk_size
    for at in range(0, len(view), cs):
        i = (w0 + at) // cs
        got = crc32c(view[at:at + cs])
        if got != entry.chunk_crc32c[i]:
            raise IntegrityError(
                f"{url}: chunk {i} (bytes [{w0 + at}, {w0 + min(len(view), at + cs)})) fails its "
                f"CRC32C check (recorded {entry.chunk_crc32c[i]:08x}, read {got:08x}); the file "
                "is corrupted")


Put = Callable[[Any, int, Slot, int, int], None]


def pipelined_reads(files: Sequence[FileReads], chunk_size: int, ring: Ring, put: Put,
                    threads: int) -> int:
    """Read, check and hand over every piece of ``files`` (see the module docstring); returns
    the bytes read from storage. Waits for every pending copy before returning."""
    per = ring.nbytes // chunk_size
    work = [(f, w0, w1, parts) for f in files
            for w0, w1, parts in windows(f.entry.size, chunk_size, f.pieces, per)]
    total = sum(w1 - w0 for _, w0, w1, _ in work)

    def one(item: tuple[FileReads, int, int, list[tuple[Any, int, int, int]]],
            abort: threading.Event) -> None:
        f, w0, w1, parts = item
        slot = ring.acquire(abort)
        try:
            view = slot.view[:w1 - w0]
            f.read(view, w0)
            check_chunks(f.entry, chunk_size, f.url, w0, view)
            for target, at, lo, hi in parts:
                put(target, at, slot, lo, hi)
        finally:
            ring.release(slot)

    try:
        run_workers(work, one, min(threads, max(1, len(work))), "read")
    finally:
        ring.drain()
    return total


def local_reader(path: str, url: str, entry: FileEntry) -> tuple[Reader, Callable[[], None]]:
    """Positioned reads of the local file ``path`` (its size checked against ``entry``) and the
    function that closes it."""
    from shardckpt.storage.local import open_regular

    f = open_regular(path, url)
    try:
        size = os.fstat(f.fileno()).st_size
        if size != entry.size:
            raise IntegrityError(f"{url}: {size} bytes, the manifest records {entry.size}")
    except BaseException:
        f.close()
        raise
    fd = f.fileno()

    def read(view: memoryview, pos: int) -> None:
        pread_full(fd, view, pos, url)

    return read, f.close
