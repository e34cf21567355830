"""Load checkpoint bytes into live shards on any device through the read pipeline of
:mod:`shardckpt.storage.pipeline`: the spans a load plan names are read into a small ring of host
buffers (pinned where a destination is on CUDA), each chunk's CRC32C checked in worker threads,
and copied into the shards' own memory: on CPU with ``copy_``, on CUDA ``non_blocking`` on a side
stream, overlapped with the next reads (a buffer is refilled only once its copy is done). No
full-size host copy of the state is made, and the destination shards are never copied to the host.

:func:`fill_shards` serves every load of flat groups (:func:`~shardckpt.training.save_load.load`,
so also a load-time reshard, where spans come from several source files, and the local tier's
load into device shards); state kept in offload files (``write_bytes``) is written through
:meth:`~shardckpt.checkpoint.reader.CheckpointReader.read_ranges` as before. The ring, the
copier and the fill itself are in :mod:`shardckpt.checkpoint.tensor_reads`, which the peer stream
into device shards and DCP's storage reader use too.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.tensor_reads import (  # noqa: F401 - byte_view, host_ring: device_save's
    Copier, Request, Target, byte_view, fill_tensors, host_ring, tensor_itemsize,
)
from shardckpt.storage import IOConfig


def fill_shards(reader: CheckpointReader, requests: Sequence[Request], targets: Sequence[Target],
                config: IOConfig | None = None) -> int:
    """Read every request ``(file, start, end)`` into its target ``(tensor, first element,
    elements)``; returns the bytes the requests name."""
    offload = [i for i, (t, _, _) in enumerate(targets) if hasattr(t, "write_bytes")]
    if offload:  # state in offload files: written in place, the rest pipelined
        data = reader.read_ranges([requests[i] for i in offload])
        for i, d in zip(offload, data, strict=True):
            tensor, off, _ = targets[i]
            tensor.write_bytes(off * tensor_itemsize(tensor), d)
        rest = [i for i in range(len(targets)) if i not in set(offload)]
        return sum(len(d) for d in data) + fill_shards(
            reader, [requests[i] for i in rest], [targets[i] for i in rest], config)
    return fill_tensors(reader, requests, targets, config)
