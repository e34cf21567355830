"""``reshard --format flat``: a checkpoint of chunked tensors (saved through DCP) as ``ZeroEngine``
flat groups for M ranks, as ``import dcp --ranks M`` writes them.

The planning is ``import dcp``'s (:func:`shardckpt.interop.dcp.model_state.read_model`, which
tensor is a parameter, its Adam moments, a frozen parameter or a buffer; and
:func:`~shardckpt.interop.dcp.to_flat.flat_spec`, the layout and the manifest-to-be), and so are
the bytes of each shard (:func:`~shardckpt.interop.dcp.to_flat.flat_producer`): the output is the
import's, file for file. What differs is the flow around it: reshard's (destination guards,
``--overwrite``, lease, ``--workers`` and ``torchrun`` shares, commit). Reads go through the
checked read path in pieces of at most ``buffer_bytes``. Decoding the optimizer's values (blobs)
and casting to fp32 load torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator, Sequence

from shardckpt.checkpoint.chunked_read import iter_elements
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.format.layout import Layout, Mesh
from shardckpt.format.manifest import FileEntry, TensorSlot, shard_slots
from shardckpt.storage import Storage
from shardckpt.tools.reshard_stream import Written

if TYPE_CHECKING:
    from shardckpt.format.manifest import Manifest
    from shardckpt.interop.dcp.model_state import DcpModel

__all__ = ["FlatFromChunks", "flat_target"]


class _Counted:
    """A :class:`~shardckpt.checkpoint.chunked_read.RangeSource` whose checked reads count their
    bytes (and tell ``on_bytes``)."""

    def __init__(self, reader: CheckpointReader, on_bytes: Callable[[int], None] | None) -> None:
        self.reader, self.on_bytes, self.bytes_read = reader, on_bytes, 0

    @property
    def manifest(self) -> Manifest:
        return self.reader.manifest

    @property
    def url(self) -> str:
        return self.reader.url

    def read_ranges(self, requests: list[tuple[FileEntry, int, int]], workers: int = 8) -> list[memoryview]:
        views = self.reader.read_ranges(requests, workers)
        n = sum(len(v) for v in views)
        self.bytes_read += n
        if self.on_bytes:
            self.on_bytes(n)
        return views


@dataclass(frozen=True)
class FlatFromChunks:
    """Flat groups from chunked tensors: the spec and layout ``import dcp --ranks`` plans, and
    ``model``, which tensor is what. A target of :mod:`shardckpt.tools.reshard`."""

    spec: CheckpointSpec
    layout: Layout
    model: DcpModel

    def writer(self, dst: Storage, save_id: str | None = None) -> CheckpointWriter:
        return CheckpointWriter(dst, self.spec, save_id)

    def data_bytes(self, writer: CheckpointWriter) -> int:
        return writer.data_bytes()

    def costs(self) -> list[int]:
        """Bytes written (about those read, too), per shard file."""
        slots = shard_slots(self.spec.components, self.spec.mesh)
        return [2 * slots[-1].end if slots else 0] * self.spec.mesh.shard_degree

    def write(self, reader: CheckpointReader, writer: CheckpointWriter, files: Sequence[int],
              buffer_bytes: int, on_bytes: Callable[[int], None] | None) -> Written:
        from shardckpt.interop.dcp.to_flat import flat_producer

        counted = _Counted(reader, on_bytes)
        entries = tuple(writer.write_shard(s, flat_producer(counted, self.model, self.layout, s,
                                                            buffer_bytes)) for s in files)
        return Written(entries, counted.bytes_read)

    def has_buffers(self, reader: CheckpointReader) -> bool:
        return bool(self.model.buffers)

    def write_buffers(self, reader: CheckpointReader, writer: CheckpointWriter,
                      buffer_bytes: int) -> FileEntry | None:
        def produce(slot: TensorSlot) -> Iterator[Any]:
            t = self.model.buffers[slot.name]
            yield from iter_elements(reader, t, 0, t.numel, buffer_bytes)

        return writer.write_buffers(produce)


def flat_target(reader: CheckpointReader, mesh: Mesh) -> FlatFromChunks:
    """The flat groups ``import dcp --ranks`` would write from the chunked checkpoint of
    ``reader`` (default keys and unit patterns), for ``mesh``."""
    from shardckpt.interop.dcp.model_state import read_model
    from shardckpt.interop.dcp.to_flat import flat_spec

    model = read_model(reader)
    spec, layout = flat_spec(reader, model, mesh, None, reader.url)
    return FlatFromChunks(spec, layout, model)
