"""Import a checkpoint written by DCP's own ``FileSystemWriter`` as a shardckpt checkpoint.

What DCP writes: ``.metadata`` (a pickle of :class:`torch.distributed.checkpoint.metadata.Metadata`:
every tensor's global shape, dtype and chunks, the keys of non-tensor values, and, per item, the
file, byte offset and length where it went) and ``__<rank>_<n>.distcp`` payload files, in which
each tensor chunk is a ``torch.save`` archive at its offset and each non-tensor value is the bytes
DCP's planner serialized.

How it is read (docs/FORMAT.md, "Foreign formats"): the metadata only through
:class:`~shardckpt.interop.dcp.source.MetadataUnpickler` (:mod:`shardckpt.interop.dcp.source`), whose ``find_class`` admits DCP's metadata classes, ``torch.Size``,
dtypes and plain containers and refuses every other global by name (decoded as plain records,
:mod:`shardckpt.interop.dcp.records`, so neither torch nor DCP is imported); a tensor payload, one
chunk at a time, as the bytes of its storage where it is a plain contiguous tensor of the stated
dtype and shape (:mod:`shardckpt.interop.dcp.payload`, an allow-listing unpickler), else through
``torch.load(weights_only=True)`` on its byte range; non-tensor values are copied as opaque
blobs, never deserialized. Everything the metadata says is checked before a byte
is written (files present, ranges inside them, the chunks of every tensor tiling it); a payload
that does not decode to the tensor the metadata describes stops the import with nothing committed.

The output keeps DCP's chunks (format 1.2 chunked tensors): one ``chunks`` file per source file,
loadable through :class:`shardckpt.interop.dcp.storage.ShardckptReader` and read by every offline tool.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Mapping

from shardckpt.checkpoint.attempt import Attempt, Steps
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.reader import as_storage
from shardckpt.interop.dcp.payload import distinct_elements, plain_bytes, stored_only
from shardckpt.interop.dcp.source import DcpSource, Item, read_dcp

from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter, new_save_id
from shardckpt.format.chunked import (
    Blob, ChunkRecord, ChunkedSection, ChunkedTensor, blob_name, chunk_name,
)
from shardckpt.errors import ConfigError, IntegrityError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import Mesh, prod
from shardckpt.format.manifest import MANIFEST_NAME, Manifest, TensorSlot
from shardckpt.format.records import RunExtras
from shardckpt.interop.dcp.config import DcpConfig, DcpOrigin
from shardckpt.storage import Storage
from shardckpt.interop.importer import ImportOptions, ImportPlan, get_importer, run_importer

log = logging.getLogger(__name__)

__all__ = ["import_dcp", "plan_chunks", "write_chunks", "load_chunk", "chunk_bytes"]


def _read_item(storage: Storage, it: Item) -> bytes:
    data = storage.read(it.file, it.offset, it.offset + it.length)
    if len(data) != it.length:
        raise IntegrityError(f"{storage.url_of(it.file)}: {it.fqn!r}: read {len(data)} of "
                             f"{it.length} bytes at {it.offset}; the file is truncated")
    return data


def load_chunk(storage: Storage, it: Item, dtype: str, data: bytes | None = None) -> Any:
    """The tensor chunk ``it`` (its byte range, or ``data``, through
    ``torch.load(weights_only=True)``), checked to be the dtype and shape the metadata says."""
    import torch

    url = storage.url_of(it.file)
    where = f"{it.fqn!r} at offsets {list(it.offsets or ())}"
    data = _read_item(storage, it) if data is None else data
    bad = stored_only(data)
    if bad:  # torch.load would inflate it: memory no longer bounded by what is read
        raise IntegrityError(f"{url}: {where}: bytes [{it.offset}, {it.offset + it.length}) are "
                             f"not a torch.save archive of stored entries: {bad}")
    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a foreign payload: any failure is one clear error
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise IntegrityError(f"{url}: {where}: bytes [{it.offset}, {it.offset + it.length}) are "
                             f"not a readable torch.save tensor: {first}") from None
    if not isinstance(t, torch.Tensor):
        raise IntegrityError(f"{url}: {where} holds a {type(t).__name__}, not a tensor")
    got = str(t.dtype).removeprefix("torch.")
    if got != dtype or tuple(t.shape) != it.sizes:
        raise IntegrityError(f"{url}: {where} holds a {got} tensor of shape {list(t.shape)}; the "
                             f"metadata says {dtype} {list(it.sizes)}")
    held = t.untyped_storage().nbytes()
    if not distinct_elements(tuple(t.shape), tuple(t.stride())) or held < t.numel() * t.element_size():
        raise IntegrityError(f"{url}: {where} is a view (strides {list(t.stride())}) that repeats "
                             f"elements of its {held}-byte storage; a payload's storage must hold "
                             "every element of its tensor")
    return t


def chunk_bytes(storage: Storage, it: Item, dtype: str) -> Any:
    """The tensor chunk ``it`` as row-major bytes: a view of its payload where that is a plain
    contiguous tensor of the metadata's dtype and shape (:mod:`shardckpt.interop.dcp.payload`,
    without torch), else decoded by :func:`load_chunk`."""
    data = _read_item(storage, it)
    view = plain_bytes(data, dtype, it.sizes)
    if view is not None:
        return view
    import torch

    t = load_chunk(storage, it, dtype, data)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _plan(source: DcpSource, save_id: str
          ) -> tuple[list[list[TensorSlot]], ChunkedSection, dict[str, Item]]:
    """Per output file (one per source file), its slots; the chunked section; item by slot."""
    files: list[list[TensorSlot]] = []
    by_name: dict[str, Item] = {}
    chunks: dict[str, list[ChunkRecord]] = {f: [] for f in source.tensors}
    blobs: dict[str, Blob] = {}
    for i, its in enumerate(source.items.values()):
        rel = f"{save_id}/chunks-{i:05d}.safetensors"  # as CheckpointWriter.write_chunks names it
        slots, pos = [], 0
        for it in its:
            shape: tuple[int, ...]
            if it.offsets is None:
                name, dtype, shape, n = blob_name(it.fqn), "uint8", (it.length,), it.length
                blobs[it.fqn] = Blob(it.fqn, rel, pos, pos + n)
            else:
                dtype, _ = source.tensors[it.fqn]
                name, shape = chunk_name(it.fqn, it.offsets), it.sizes
                n = prod(shape) * itemsize(dtype)
                chunks[it.fqn].append(ChunkRecord(it.offsets, it.sizes, rel, pos, pos + n))
            slots.append(TensorSlot(name, dtype, shape, pos, pos + n))
            by_name[f"{i}:{name}"] = it
            pos += n
        files.append(slots)
    tensors = {f: ChunkedTensor(f, d, s, tuple(chunks[f])) for f, (d, s) in source.tensors.items()}
    return files, ChunkedSection(tensors, blobs, source.planner_data), by_name


def import_dcp(src: str | Storage, dst: str | Storage,
               storage_options: Mapping[str, Any] | None = None,
               dst_storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Write the DCP checkpoint ``src`` as a chunked shardckpt checkpoint at ``dst``.

    Keeps DCP's chunks and keys (``dcp.load`` through :class:`shardckpt.interop.dcp.storage.ShardckptReader`
    gives back what ``dcp.load`` of the source gives). Memory: one source chunk at a time. Refuses
    a ``dst`` that holds a checkpoint; on any error nothing is committed. The ``dcp`` importer
    (:mod:`shardckpt.interop.dcp.importer`) without ``ranks``.
    """
    options = ImportOptions(src, dst, storage_options=storage_options,
                            dst_storage_options=dst_storage_options, config=DcpConfig())
    return run_importer(get_importer("dcp"), options)


@dataclass
class _Chunks:
    """What :func:`write_chunks` reads of a plan: the source, the save id the output files are
    named by, their slots, the source item of each slot."""

    store: Storage
    save_id: str
    files: list[list[TensorSlot]]
    by_name: dict[str, Item]
    section: ChunkedSection


def plan_chunks(options: ImportOptions) -> ImportPlan:
    """The plan of :func:`import_dcp`: the destination checked, the source's metadata read and
    checked against its files, one ``chunks`` file per source file under a new save id."""
    store = as_storage(options.src, options.storage_options)
    out = as_storage(options.dst, options.dst_storage_options)
    if out.exists(MANIFEST_NAME):
        raise ConfigError(f"{out.url_of(MANIFEST_NAME)} exists; import into an empty location")
    source = read_dcp(store)
    save_id = new_save_id()
    files, section, by_name = _plan(source, save_id)
    spec = CheckpointSpec(Mesh.for_world(max(1, len(files))), {},
                          extras=RunExtras(source=store.url, other=DcpOrigin(
                              source.version, tuple(sorted(source.items))).entry()).to_doc(),
                          chunked=section)
    return ImportPlan(options, out, spec, "import dcp",
                      state=_Chunks(store, save_id, files, by_name, section))


def write_chunks(plan: ImportPlan) -> Manifest:
    """Write a plan of :func:`plan_chunks` (one process) and commit; on any error nothing is
    committed and the attempt's files are removed."""
    chunks, out, spec = plan.state, plan.out, plan.spec
    assert isinstance(chunks, _Chunks) and spec.chunked is not None
    store, files, by_name, section = chunks.store, chunks.files, chunks.by_name, chunks.section

    def producer(i: int) -> Any:
        def produce(slot: TensorSlot) -> Iterator[Any]:
            it = by_name[f"{i}:{slot.name}"]
            yield _read_item(store, it) if it.offsets is None else chunk_bytes(store, it, slot.dtype)
        return produce

    # one process: the guard ran in plan_chunks, and the reports travel as they are
    attempt = Attempt(Job.single(), out.url, Steps.named("import dcp"),
                      lambda save_id: CheckpointWriter(out, spec, save_id), save_id=chunks.save_id,
                      room=lambda w: out.ensure_free_space("", sum(s[-1].end for s in files if s),
                                                           "import dcp"))
    m = attempt.run(lambda w: [w.write_chunks(i, slots, producer(i)) for i, slots in enumerate(files)],
                    lambda w, reports: w.commit(reports[0]))
    assert m is not None
    log.info("imported %s (%d tensors, %d values) -> %s", store.url, len(section.tensors),
             len(section.blobs), out.url)
    return m
