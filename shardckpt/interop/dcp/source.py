"""A checkpoint DCP's own ``FileSystemWriter`` wrote, read for an import: its ``.metadata`` through
an allow-list (:class:`MetadataUnpickler`), and every tensor's chunks and every value checked
against the payload files before a byte is copied (:func:`read_dcp`). How the import uses it:
:mod:`shardckpt.interop.dcp.import_`.
"""

from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from shardckpt.errors import IntegrityError
from shardckpt.format.chunk_tiling import tiling_problems
from shardckpt.format.chunked import ChunkRecord, ChunkedTensor
from shardckpt.format.dtypes import DTYPES, itemsize
from shardckpt.format.layout import prod
from shardckpt.interop.dcp import records as dcp_records
from shardckpt.storage import NotFoundError, Storage
from shardckpt.storage import check_inside

__all__ = ["METADATA_NAME", "DcpSource", "Item", "MetadataUnpickler", "read_dcp", "read_dcp_metadata"]

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
class Item:
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
    items: dict[str, list[Item]]                      # payload file -> items, in byte order
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
    items: dict[str, list[Item]] = {}
    for fqn, tmd in state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise IntegrityError(f"{url}: a key is {type(fqn).__name__}, not a string")
        if isinstance(tmd, dcp_records.BytesStorageMetadata):
            path, off, n = _storage_info(md, url, fqn, None)
            items.setdefault(path, []).append(Item(fqn, None, (n,), path, off, n))
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
            items.setdefault(path, []).append(Item(fqn, c.offsets, c.sizes, path, pos, n))
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
