"""Load checkpoint bytes into live shards on any device through the read pipeline of
:mod:`shardckpt.storage.pipeline`: the spans a load plan names are read into a small ring of host
buffers (pinned where a destination is on CUDA), each chunk's CRC32C checked in worker threads,
and copied into the shards' own memory: on CPU with ``copy_``, on CUDA ``non_blocking`` on a side
stream, overlapped with the next reads (a buffer is refilled only once its copy is done). No
full-size host copy of the state is made, and the destination shards are never copied to the host.

:func:`fill_shards` serves every load of flat groups (:func:`~shardckpt.training.save_load.load`,
so also a load-time reshard, where spans come from several source files, and the local tier's
load into device shards); state kept in offload files (``write_bytes``) is written through
:meth:`~shardckpt.checkpoint.reader.CheckpointReader.read_ranges` as before.
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
)

Request = tuple[FileEntry, int, int]      # file, absolute byte range
Target = tuple[Any, int, int]             # tensor, first element, elements


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
        """The shards are usable on each device's current stream once this returns."""
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


def _reader_of(reader: CheckpointReader, entry: FileEntry,
               closers: list[Callable[[], None]]) -> tuple[str, Reader]:
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


def fill_shards(reader: CheckpointReader, requests: Sequence[Request], targets: Sequence[Target],
                config: IOConfig | None = None) -> int:
    """Read every request ``(file, start, end)`` into its target ``(tensor, first element,
    elements)``; returns the bytes the requests name."""
    offload = [i for i, (t, _, _) in enumerate(targets) if hasattr(t, "write_bytes")]
    if offload:  # state in offload files: written in place, the rest pipelined
        data = reader.read_ranges([requests[i] for i in offload])
        for i, d in zip(offload, data, strict=True):
            tensor, off, _ = targets[i]
            tensor.write_bytes(off * _itemsize(tensor), d)
        rest = [i for i in range(len(targets)) if i not in set(offload)]
        return sum(len(d) for d in data) + fill_shards(
            reader, [requests[i] for i in rest], [targets[i] for i in rest], config)
    if not requests:
        return 0
    cfg = config or IOConfig.from_env()
    cs = reader.manifest.chunk_size
    files: dict[str, FileReads] = {}
    closers: list[Callable[[], None]] = []
    views: dict[int, Any] = {}
    copier = Copier()
    try:
        for (entry, a, b), (tensor, off, _) in zip(requests, targets, strict=True):
            f = files.get(entry.path)
            if f is None:
                url, read = _reader_of(reader, entry, closers)
                f = files[entry.path] = FileReads(entry, url, read)
            dst = views.setdefault(id(tensor), byte_view(tensor))
            f.pieces.append((a, b, (dst, off * _itemsize(tensor))))
        pinned = _pinnable() and any(getattr(t, "is_cuda", False) for t, _, _ in targets)
        ring = host_ring(cfg, cfg.slot_bytes(cs), pinned)
        try:
            pipelined_reads(list(files.values()), cs, ring, copier.put, cfg.threads)
        finally:
            copier.finish()
    finally:
        for close in closers:
            close()
    return sum(b - a for _, a, b in requests)


def _itemsize(t: Any) -> int:
    return itemsize(str(t.dtype).removeprefix("torch."))


def _pinnable() -> bool:
    import torch

    return torch.cuda.is_available()
