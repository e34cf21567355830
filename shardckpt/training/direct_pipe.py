"""Where :func:`~shardckpt.training.direct_load.load_direct` puts bytes: straight into the
engine's shards, on any device.

CPU shards of their own memory take the plain direct path: each span read with ``readinto``
into the shard, a file in windows of whole chunks on several threads
(:func:`~shardckpt.storage.read_windows`), a peer's file received into it.
Shards on a device (or any shards, with ``SHARDCKPT_IO_PIPELINE=1``) go through the read
pipeline (:mod:`shardckpt.checkpoint.tensor_reads`): this node's files read into the ring,
checked in worker threads and copied into the shards (``non_blocking`` on a side stream on CUDA),
and a peer's file received into the same ring (:mod:`.peer_pipe`). A target is then a memoryview
of a CPU shard, or ``(bytes of the shard as a uint8 tensor, byte offset)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.tensor_reads import (
    Copier, byte_view, cpu_bytes, host_ring, pinnable, reader_of,
)
from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import FileReads, IOConfig, Storage, pipelined_reads, read_windows

ByFile = Mapping[str, tuple[FileEntry, list[tuple[int, int, Any]]]]


def loadable(t: Any) -> bool:
    """Whether shard ``t`` takes bytes straight into its own memory (contiguous, any device)."""
    return getattr(t, "device", None) is not None and t.is_contiguous()


def pipelined(tensors: Iterable[Any]) -> bool:
    """Whether a direct load into ``tensors`` goes through the pipeline (see the module docstring)."""
    return IOConfig.from_env().every_device or any(t.device.type != "cpu" for t in tensors)


def target_view(t: Any, through_pipeline: bool) -> Any:
    """What pieces of shard ``t`` are cut from (:func:`piece`)."""
    return byte_view(t) if through_pipeline else cpu_bytes(t)


def piece(view: Any, a: int, b: int) -> Any:
    """The target of bytes ``[a, b)`` of a shard whose :func:`target_view` is ``view``."""
    return view[a:b] if isinstance(view, memoryview) else (view, a)


def header_target(n: int, through_pipeline: bool) -> tuple[Callable[[], bytes], Any]:
    """A buffer of ``n`` bytes for a file's header received from a peer: (its bytes, the target)."""
    if not through_pipeline:
        buf = bytearray(n)
        return (lambda: bytes(buf)), memoryview(buf)
    import torch

    t = torch.empty(n, dtype=torch.uint8)
    return (lambda: t.numpy().tobytes()), (t, 0)


def read_local(reader: CheckpointReader, by_file: ByFile, skip: set[str], through_pipeline: bool,
               tensors: Iterable[Any]) -> list[tuple[Storage, str, str]]:
    """Fill the pieces of every file of ``by_file`` not in ``skip`` from this node's copy (its
    header checked first); returns the copies that fail a check (holder, path, why), the other
    files read on."""
    cs = reader.manifest.chunk_size
    damaged: list[tuple[Storage, str, str]] = []
    cfg = IOConfig.from_env()
    copier = Copier()
    ring = host_ring(cfg, cfg.slot_bytes(cs), pinnable(list(tensors))) if through_pipeline else None
    try:
        for entry, pieces in by_file.values():
            if entry.path in skip:
                continue
            holder, rel = reader.files.locate(entry.path)
            closers: list[Callable[[], None]] = []
            try:
                reader.check_file(entry)
                if ring is None:
                    read_windows([(holder.full(rel), holder.url_of(rel), entry, pieces)], cs,
                                 cfg.threads)
                    continue
                url, read = reader_of(reader, entry, closers)
                pipelined_reads([FileReads(entry, url, read, list(pieces))], cs, ring, copier.put,
                                cfg.threads)
            except IntegrityError as e:  # this node's copy: moved aside by the caller
                damaged.append((holder, rel, str(e)))
            finally:
                for close in closers:
                    close()
    finally:
        copier.finish()
    return damaged
