"""Checkpoint bytes into tensors' own memory through the read pipeline of
:mod:`shardckpt.storage.pipeline`, whatever the tensors' device: a small ring of host buffers
(page-locked where a destination is on CUDA), each chunk's CRC32C checked in worker threads, and a
copy into each destination (``copy_`` on CPU; on CUDA ``non_blocking`` on a side stream, overlapped
with the next reads: a buffer is refilled only once its copy is done). Nothing holds a full-size
host copy of what is read, and the destinations are never copied to the host.

Where every destination is in CPU memory and a file is on a local disk, :func:`fill_tensors`
reads it straight into the tensors instead (:func:`~shardckpt.storage.read_windows`), unless
``SHARDCKPT_IO_PIPELINE=1`` (or ``IOConfig.every_device``) asks for the ring.

Used by the load of a running job (:mod:`shardckpt.training.device_load`), the peer stream into
device shards (:mod:`shardckpt.training.peer_pipe`) and DCP's storage reader into tensors
(:mod:`shardckpt.interop.dcp.tensor_boxes`). Torch is imported inside functions only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import IntegrityError, ShardckptError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import (
    FileReads, IOConfig, Reader, Ring, Slot, local_path, local_reader, pipelined_reads,
    read_windows,
)

Request = tuple[FileEntry, int, int]      # file, absolute byte range
Target = tuple[Any, int, int]             # tensor, first element, elements
Piece = tuple[int, int, Any, int]         # absolute byte range, its tensor, byte offset in it


def host_ring(config: IOConfig, nbytes: int, pinned: bool) -> Ring:
    """A ring of ``config.buffers`` host buffers of ``nbytes`` (uint8 tensors, page-locked when
    ``pinned``), allocated on first use."""
    import torch

    def alloc(n: int) -> tuple[memoryview, Any]:
        t = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        return t.numpy().data.cast("B"), t

    return Ring(config.buffers, nbytes, alloc)


class Copier:
    """The ``put`` of a pipelined load into tensors: ``target`` is ``(bytes of a destination
    tensor, byte offset of the piece in it)``. CUDA destinations get a ``non_blocking`` copy on
    one side stream per device (which first waits for the work queued on the device's current
    stream); the slot then waits for that copy before it is refilled."""

    def __init__(self) -> None:
        self.streams: dict[Any, Any] = {}
        self.lock = threading.Lock()

    def stream(self, device: Any) -> Any:
        import torch

        with self.lock:
            s = self.streams.get(device)
            if s is None:
                s = self.streams[device] = torch.cuda.Stream(device)
                s.wait_stream(torch.cuda.current_stream(device))
            return s

    def put(self, target: tuple[Any, int], at: int, slot: Slot, lo: int, hi: int) -> None:
        import torch

        dst, base = target
        out, src = dst[base + at:base + at + hi - lo], slot.handle[lo:hi]
        if not out.is_cuda:
            out.copy_(src)
            return
        s = self.stream(out.device)
        with torch.cuda.stream(s):
            out.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(s)
        before = slot.wait
        slot.wait = done.synchronize if before is None else _both(before, done.synchronize)

    def finish(self) -> None:
        """The destinations are usable on each device's current stream once this returns."""
        import torch

        for device, s in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(s)
            s.synchronize()


def _both(a: Callable[[], None], b: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        a()
        b()
    return run


def byte_view(tensor: Any) -> Any:
    """A 1-D uint8 tensor over ``tensor``'s own memory (refused where it has none of its own
    layout: writes to a copy would be lost)."""
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        raise ShardckptError("a shard to load into is not contiguous; shards are 1-D tensors")
    return t.reshape(-1).view(torch.uint8)


def pinnable(tensors: Sequence[Any]) -> bool:
    """Whether the ring for these destinations is page-locked (one of them is on CUDA)."""
    import torch

    return torch.cuda.is_available() and any(getattr(t, "is_cuda", False) for t in tensors)


def reader_of(reader: CheckpointReader, entry: FileEntry,
              closers: list[Callable[[], None]]) -> tuple[str, Reader]:
    """The URL of ``entry`` and positioned reads of it (a local file opened once, its close
    appended to ``closers``; ranged reads of any other store)."""
    holder, rel = reader.files.locate(entry.path)
    url = holder.url_of(rel)
    if local_path(holder.url) is not None:
        read, close = local_reader(holder.full(rel), url, entry)
        closers.append(close)
        return url, read

    def remote(view: memoryview, pos: int) -> None:
        data = holder.read(rel, pos, pos + len(view))
        if len(data) != len(view):
            raise IntegrityError(f"{url}: bytes [{pos}, {pos + len(view)}) gave {len(data)} bytes")
        view[:] = data

    return url, remote


def fill_tensors(reader: CheckpointReader, requests: Sequence[Request], targets: Sequence[Target],
                 config: IOConfig | None = None) -> int:
    """Read every request ``(file, start, end)`` into its target ``(tensor, first element,
    elements)`` (each tensor contiguous, of any device); returns the bytes the requests name.

    Where every target is in CPU memory, the files on a local disk are read straight into the
    tensors (:func:`~shardckpt.storage.read_windows`: no ring, no copy); a file elsewhere, a
    target on a device, or every file with ``SHARDCKPT_IO_PIPELINE=1`` goes through the
    pipeline."""
    if not requests:
        return 0
    cfg = config or IOConfig.from_env()
    cs = reader.manifest.chunk_size
    by_file: dict[str, tuple[FileEntry, list[Piece]]] = {}
    for (entry, a, b), (tensor, off, _) in zip(requests, targets, strict=True):
        by_file.setdefault(entry.path, (entry, []))[1].append(
            (a, b, tensor, off * tensor_itemsize(tensor)))
    cpu = {} if cfg.every_device else {
        id(t): v for t, _, _ in targets if (v := cpu_bytes(t)) is not None}
    plain = bool(cpu) and len(cpu) == len({id(t) for t, _, _ in targets})
    direct: list[tuple[str, str, FileEntry, list[tuple[int, int, memoryview]]]] = []
    piped: list[tuple[FileEntry, list[Piece]]] = []
    for entry, pieces in by_file.values():
        holder, rel = reader.files.locate(entry.path)
        if not (plain and local_path(holder.url) is not None):
            piped.append((entry, pieces))
            continue
        direct.append((holder.full(rel), holder.url_of(rel), entry,
                       [(a, b, _cut(cpu[id(t)], at, b - a)) for a, b, t, at in pieces]))
    read_windows(direct, cs, cfg.threads)
    if piped:
        _fill_piped(reader, piped, cfg)
    return sum(b - a for _, a, b in requests)


def _cut(view: memoryview, at: int, n: int) -> memoryview:
    if at < 0 or at + n > len(view):
        raise ShardckptError(f"bytes [{at}, {at + n}) of a tensor to load into lie outside its "
                             f"{len(view)} bytes")
    return view[at:at + n]


def _fill_piped(reader: CheckpointReader, by_file: Sequence[tuple[FileEntry, list[Piece]]],
                cfg: IOConfig) -> None:
    """The pieces ``(start, end, tensor, byte offset)`` of each file through the read pipeline."""
    files: list[FileReads] = []
    closers: list[Callable[[], None]] = []
    views: dict[int, Any] = {}
    copier = Copier()
    try:
        for entry, pieces in by_file:
            url, read = reader_of(reader, entry, closers)
            files.append(FileReads(entry, url, read, [
                (a, b, (views.setdefault(id(t), byte_view(t)), at)) for a, b, t, at in pieces]))
        tensors = [t for _, pieces in by_file for _, _, t, _ in pieces]
        ring = host_ring(cfg, cfg.slot_bytes(reader.manifest.chunk_size), pinnable(tensors))
        try:
            pipelined_reads(files, reader.manifest.chunk_size, ring, copier.put, cfg.threads)
        finally:
            copier.finish()
    finally:
        for close in closers:
            close()


def cpu_bytes(t: Any) -> memoryview | None:
    """A writable byte view of CPU tensor ``t``'s own memory, or None where there is none."""
    import torch

    if getattr(t, "device", None) is None or t.device.type != "cpu" or not t.is_contiguous():
        return None
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def tensor_itemsize(t: Any) -> int:
    return itemsize(str(t.dtype).removeprefix("torch."))
