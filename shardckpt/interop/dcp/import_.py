"""Import a checkpoint written by DCP's own ``FileSystemWriter`` as a shardckpt checkpoint.

What DCP writes: ``.metadata`` (a pickle of :class:`torch.distributed.checkpoint.metadata.Metadata`:
every tensor's global shape, dtype and chunks, the keys of non-tensor values, and, per item, the
file, byte offset and length where it went) and ``__<rank>_<n>.distcp`` payload files, in which
each tensor chunk is a ``torch.save`` archive at its offset and each non-tensor value is the bytes
DCP's planner serialized.

How it is read (docs/FORMAT.md, "Foreign formats"): the metadata only through
:class:`MetadataUnpickler`, whose ``find_class`` admits DCP's metadata classes, ``torch.Size``,
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
import pickle
import re
from dataclasses import dataclass
from typing import Any, TypeGuard
from collections.abc import Iterator, Mapping

from shardckpt.checkpoint.attempt import Attempt, Steps
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.reader import as_storage
from shardckpt.interop.dcp import records as dcp_records
from shardckpt.interop.dcp.payload import distinct_elements, plain_bytes, stored_only

from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter, new_save_id
from shardckpt.format.chunked import (
    Blob, ChunkRecord, ChunkedSection, ChunkedTensor, blob_name, chunk_name, tiling_problems,
)
from shardckpt.errors import ConfigError, IntegrityError
from shardckpt.format.dtypes import DTYPES, itemsize
from shardckpt.format.layout import Mesh, prod
from shardckpt.format.manifest import MANIFEST_NAME, Manifest, TensorSlot
from shardckpt.format.records import DcpOrigin, RunExtras
from shardckpt.storage import NotFoundError, Storage
from shardckpt.storage.links import check_inside
from shardckpt.interop.importer import ImportOptions, ImportPlan, get_importer, run_importer

log = logging.getLogger(__name__)

__all__ = ["import_dcp", "read_dcp_metadata", "MetadataUnpickler"]

METADATA_NAME = ".metadata"
#: A ``.metadata`` larger than this is refused before it is unpickled.
MAX_METADATA_BYTES = 1 << 30
_MD = "torch.distributed.checkpoint.metadata"
_DTYPE_NAMES = tuple(DTYPES) + ("complex64", "complex128")
_PAYLOAD = re.compile(r"[A-Za-z0-9_.-]+")
#: Offsets, lengths, sizes and shapes in the metadata are below this (as in a manifest).
MAX_INT = 1 << 63


def _show(v: Any) -> str:
    """``repr(v)``, short: a huge integer by its size (its digits would be an error of their own
    past Python's limit, and unreadable before it), anything else cut at 80 characters."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= MAX_INT:
        return f"<an integer of {v.bit_length()} bits>"
    if isinstance(v, (tuple, list)) and any(isinstance(x, int) and abs(x) >= MAX_INT for x in v):
        return "[" + ", ".join(_show(x) for x in v[:8]) + (", ...]" if len(v) > 8 else "]")
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 - a foreign object whose repr fails
        r = f"<a {type(v).__name__}>"
    return r if len(r) <= 80 else r[:77] + "..."


def _count(x: Any) -> TypeGuard[int]:
    """A non-negative integer (not a bool) below :data:`MAX_INT`."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_INT


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: ``find_class`` admits DCP's metadata
    dataclasses, the ``FileSystemWriter``'s per-item storage record, ``torch.Size``, dtypes and
    layouts, ``OrderedDict`` and ``PosixPath`` (the checkpoint id DCP records); any other global is
    refused by name, before it is imported or called."""

    def __init__(self, file: Any, url: str, records: bool = False) -> None:
        super().__init__(file)
        self.url, self.records = url, records

    def find_class(self, module: str, name: str) -> Any:
        import collections
        import pathlib

        allowed: dict[tuple[str, str], Any] = {("collections", "OrderedDict"): collections.OrderedDict,
                   ("pathlib", "PosixPath"): pathlib.PosixPath,
                   ("pathlib", "PurePosixPath"): pathlib.PurePosixPath}
        if self.records:  # the same globals, as plain records: neither torch nor DCP imported
            if module == "torch" and name in _DTYPE_NAMES:
                return dcp_records.dtype_name(name)
            allowed.update(dcp_records.RECORDS)
        else:
            import torch
            from torch.distributed.checkpoint import filesystem, metadata

            if module == "torch" and name in _DTYPE_NAMES and isinstance(getattr(torch, name, None),
                                                                         torch.dtype):
                return getattr(torch, name)
            allowed.update({k: getattr(metadata, k[1]) for k in dcp_records.RECORDS if k[0] == _MD})
            allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = \
                filesystem._StorageInfo
            allowed[("torch", "Size")] = torch.Size
            allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
        if (module, name) not in allowed:
            raise IntegrityError(f"{self.url}: names the global {module}.{name}, which is not one "
                                 "of DCP's metadata classes; refused without running it")
        return allowed[(module, name)]


@dataclass(frozen=True)
class _Item:
    """One stored value: a tensor chunk (``offsets``/``sizes``) or a blob (``offsets`` None)."""

    fqn: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass
class DcpSource:
    """A DCP checkpoint's metadata, checked against its files."""

    url: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]   # fqn -> (dtype, shape)
    items: dict[str, list[_Item]]                      # payload file -> items, in byte order
    planner_data: dict[str, tuple[str | int, ...]]
    version: str | None


def read_dcp_metadata(storage: Storage, records: bool = False) -> Any:
    """The ``Metadata`` in ``storage``'s ``.metadata``, through :class:`MetadataUnpickler`: DCP's
    own classes, or with ``records`` the same fields as :mod:`shardckpt.interop.dcp.records`."""
    metadata_type: type
    if records:
        metadata_type = dcp_records.Metadata
    else:
        from torch.distributed.checkpoint import metadata as torch_metadata
        metadata_type = torch_metadata.Metadata

    url = storage.url_of(METADATA_NAME)
    check_inside(storage, METADATA_NAME)
    try:
        data = storage.read_limited(METADATA_NAME, MAX_METADATA_BYTES)
    except NotFoundError:
        raise IntegrityError(f"{url}: missing; not a checkpoint DCP's FileSystemWriter wrote") from None
    try:
        md = MetadataUnpickler(io.BytesIO(data), url, records).load()
    except IntegrityError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a foreign pickle is one clear error
        raise IntegrityError(f"{url}: not a readable DCP metadata pickle (truncated or damaged): "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(md, metadata_type):
        raise IntegrityError(f"{url}: holds a {type(md).__name__}, not DCP's Metadata")
    return md


def _dtype(dtype: Any, url: str, fqn: str) -> str:
    if not isinstance(dtype, str):  # records give a dtype as its name; str() of anything else
        # (a list nested thousands deep) may itself fail
        raise IntegrityError(f"{url}: {fqn!r} has a {type(dtype).__name__} for its dtype, not "
                             "one of torch's dtypes")
    name = dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise IntegrityError(f"{url}: {fqn!r} is {name}; shardckpt stores {', '.join(DTYPES)}")
    return name


def _ints(v: Any, url: str, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or len(v) > 64 or not all(_count(x) for x in v):
        raise IntegrityError(f"{url}: {what} is {_show(v)}, not a list of non-negative integers "
                             f"below 2**63")
    return tuple(int(x) for x in v)


def _storage_info(md: Any, url: str, fqn: str, offsets: tuple[int, ...] | None) -> tuple[str, int, int]:
    where = "" if offsets is None else f" at offsets {list(offsets)}"
    key = dcp_records.MetadataIndex(fqn, offsets)
    info = md.storage_data.get(key) if isinstance(md.storage_data, dict) else None
    if not isinstance(info, dcp_records.StorageInfo):
        raise IntegrityError(f"{url}: no storage record for {fqn!r}{where}")
    # A record's fields are whatever the pickle gave: a missing one is None, refused below.
    path, off, n = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
    if not isinstance(path, str) or not _PAYLOAD.fullmatch(path) or path in (".", ".."):
        raise IntegrityError(f"{url}: {fqn!r}{where} is stored in {_show(path)}, not a file "
                             "beside it")
    if not (_count(off) and _count(n)):
        raise IntegrityError(f"{url}: {fqn!r}{where} has offset {_show(off)} and length "
                             f"{_show(n)}; expected non-negative integers below 2**63")
    if getattr(info, "transform_descriptors", None):
        raise IntegrityError(f"{url}: {fqn!r}{where} is stored with transforms "
                             f"{_show(info.transform_descriptors)}; only plain payloads are read")
    return path, off, n


def read_dcp(storage: Storage) -> DcpSource:
    """Read and check ``storage``'s DCP metadata against its payload files (nothing else read)."""
    md = read_dcp_metadata(storage, records=True)
    url = storage.url_of(METADATA_NAME)
    state_dict_metadata = getattr(md, "state_dict_metadata", None)
    if not isinstance(state_dict_metadata, dict):
        raise IntegrityError(f"{url}: state_dict_metadata is not a map")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    items: dict[str, list[_Item]] = {}
    for fqn, tmd in state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise IntegrityError(f"{url}: a key is {type(fqn).__name__}, not a string")
        if isinstance(tmd, dcp_records.BytesStorageMetadata):
            path, off, n = _storage_info(md, url, fqn, None)
            items.setdefault(path, []).append(_Item(fqn, None, (n,), path, off, n))
            continue
        chunks = getattr(tmd, "chunks", None)
        if not isinstance(tmd, dcp_records.TensorStorageMetadata) or not isinstance(chunks, list):
            raise IntegrityError(f"{url}: {fqn!r} has metadata {type(tmd).__name__} without a "
                                 "list of chunks")
        dtype = _dtype(getattr(getattr(tmd, "properties", None), "dtype", None), url, fqn)
        shape = _ints(getattr(tmd, "size", None), url, f"the shape of {fqn!r}")
        records = []
        for c in chunks:
            offs = _ints(getattr(c, "offsets", None), url, f"a chunk offset of {fqn!r}")
            sizes = _ints(getattr(c, "sizes", None), url, f"a chunk size of {fqn!r}")
            if len(offs) != len(shape) or len(sizes) != len(shape):
                raise IntegrityError(f"{url}: {fqn!r} has {len(shape)} dimensions but a chunk's "
                                     f"offsets and sizes have {len(offs)} and {len(sizes)}")
            records.append(ChunkRecord(offs, sizes, "", 0, prod(sizes) * itemsize(dtype)))
        problems = tiling_problems(ChunkedTensor(fqn, dtype, shape, tuple(records)))
        if problems:
            raise IntegrityError(f"{url}: the chunks of {fqn!r} do not tile its shape "
                                 f"{list(shape)}: {problems[0]}")
        for c in records:
            path, pos, n = _storage_info(md, url, fqn, c.offsets)
            if c.end > n:  # a payload holds at least its tensor's bytes: no stride-0 expansion
                raise IntegrityError(
                    f"{url}: {fqn!r} at offsets {list(c.offsets)} is a {dtype} box of sizes "
                    f"{list(c.sizes)} ({c.end} bytes), but its payload in {path} is {n} bytes")
            items.setdefault(path, []).append(_Item(fqn, c.offsets, c.sizes, path, pos, n))
        tensors[fqn] = (dtype, shape)
    for path, its in items.items():
        check_inside(storage, path)
        try:
            size = storage.size(path)
        except NotFoundError:
            raise IntegrityError(f"{storage.url_of(path)}: missing (the metadata stores "
                                 f"{its[0].fqn!r} there)") from None
        its.sort(key=lambda i: (i.offset, i.length))
        for it in its:
            if it.offset + it.length > size:
                raise IntegrityError(f"{storage.url_of(path)}: {it.fqn!r} is stored at bytes "
                                     f"[{it.offset}, {it.offset + it.length}), past the file's end "
                                     f"({size} bytes); the file is truncated")
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    planner_data = {k: tuple(v) for k, v in planner.items()
                    if isinstance(k, str) and isinstance(v, (tuple, list))
                    and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)}
    version = md.version if isinstance(md.version, str) else None
    return DcpSource(storage.url, tensors, dict(sorted(items.items())), planner_data, version)


def _read_item(storage: Storage, it: _Item) -> bytes:
    data = storage.read(it.file, it.offset, it.offset + it.length)
    if len(data) != it.length:
        raise IntegrityError(f"{storage.url_of(it.file)}: {it.fqn!r}: read {len(data)} of "
                             f"{it.length} bytes at {it.offset}; the file is truncated")
    return data


def load_chunk(storage: Storage, it: _Item, dtype: str, data: bytes | None = None) -> Any:
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


def chunk_bytes(storage: Storage, it: _Item, dtype: str) -> Any:
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
          ) -> tuple[list[list[TensorSlot]], ChunkedSection, dict[str, _Item]]:
    """Per output file (one per source file), its slots; the chunked section; item by slot."""
    files: list[list[TensorSlot]] = []
    by_name: dict[str, _Item] = {}
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
    from shardckpt.interop.dcp.config import DcpConfig

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
    by_name: dict[str, _Item]
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
                          extras=RunExtras(source=store.url, dcp=DcpOrigin(
                              source.version, tuple(sorted(source.items)))).to_doc(),
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
