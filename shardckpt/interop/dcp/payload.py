"""A DCP tensor payload (a ``torch.save`` archive of one plain tensor) read without torch.

DCP's ``FileSystemWriter`` stores each tensor chunk as ``torch.save(tensor)``: an uncompressed zip
holding ``<archive>/data.pkl`` (a pickle that rebuilds the tensor from a storage),
``<archive>/byteorder`` and the storage's bytes in ``<archive>/data/<key>``. :func:`plain_bytes`
reads the pickle with an unpickler whose ``find_class`` admits only what such a pickle names
(``torch._utils._rebuild_tensor_v2``, the typed storage classes, ``collections.OrderedDict``),
mapped to plain records (nothing of torch is imported or called), and returns the tensor's
row-major bytes as a view of the payload itself: no decode copy and no import of torch, which is
most of what an import of a small checkpoint costs.

Anything else (another global, a persistent id of another form, a compressed entry, big-endian
bytes, a strided or offset view, a dtype or shape other than the metadata's) gives ``None``; the
caller then decodes the payload with ``torch.load(weights_only=True)``, which reads it or refuses
it with its own error.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from shardckpt.format.dtypes import DTYPES, itemsize
from shardckpt.format.layout import prod

__all__ = ["plain_bytes", "stored_only", "distinct_elements"]

#: torch's typed storage class names -> dtype names.
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra length


class _Unsupported(Exception):
    """Not the plain layout: decode with torch.load instead."""


@dataclass(frozen=True)
class _Storage:
    dtype: str
    key: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(type(x) is int and x >= 0 for x in v):
        raise _Unsupported("sizes")
    return v


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
             hooks: Any, *rest: Any) -> _Tensor:
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0 or hooks or rest:
        raise _Unsupported("rebuild arguments")
    return _Tensor(storage, offset, _ints(size), _ints(stride))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and pid[1] in DTYPES and isinstance(pid[2], str) and type(pid[4]) is int):
            return _Storage(pid[1], pid[2], pid[4])
        raise _Unsupported("persistent id")


def _entry(data: memoryview, zf: zipfile.ZipFile, name: str) -> memoryview:
    """The bytes of stored (uncompressed) entry ``name``, as a view of ``data``."""
    info = zf.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
        raise _Unsupported("compressed")
    sig, n, e = _LOCAL_HEADER.unpack_from(data, info.header_offset)
    if sig != b"PK\x03\x04":
        raise _Unsupported("local header")
    start = info.header_offset + _LOCAL_HEADER.size + n + e
    if start + info.file_size > len(data):
        raise _Unsupported("entry past the end")
    return data[start:start + info.file_size]


def plain_bytes(payload: Any, dtype: str, shape: tuple[int, ...]) -> memoryview | None:
    """The row-major bytes of the ``dtype`` tensor of ``shape`` that ``payload`` (a
    ``torch.save`` archive) holds, as a view of ``payload``; ``None`` if it is not a plain
    contiguous tensor of exactly that (module docstring)."""
    data = memoryview(payload).cast("B")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            return None
        prefix = pkl[0][:-len("data.pkl")]
        if bytes(_entry(data, zf, prefix + "byteorder")) != b"little":
            return None
        t = _Unpickler(io.BytesIO(_entry(data, zf, pkl[0]))).load()
        if not isinstance(t, _Tensor) or t.storage.dtype != dtype or t.size != tuple(shape):
            return None
        raw = _entry(data, zf, f"{prefix}data/{t.storage.key}")
    except Exception:  # noqa: BLE001 - not the plain layout, or damaged: torch.load decides
        return None
    elem, n = itemsize(dtype), prod(shape)
    row_major: list[int] = []
    step = 1
    for d in reversed(shape):
        row_major.insert(0, step)
        step *= d
    contiguous = len(t.stride) == len(shape) and all(
        s == r for s, r, d in zip(t.stride, row_major, shape, strict=True) if d > 1)
    if (not contiguous or len(raw) != t.storage.numel * elem
            or t.offset + n > t.storage.numel):
        return None
    return raw[t.offset * elem:(t.offset + n) * elem]


def stored_only(payload: Any) -> str | None:
    """Why ``payload`` is not a zip of stored (uncompressed) entries lying inside it, or None.
    ``torch.load`` inflates a compressed entry: a few bytes read could become gigabytes held."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(memoryview(payload).cast("B")))
        infos = zf.infolist()
    except Exception as e:  # noqa: BLE001 - not a zip: torch.load refuses it with its own error
        return None if isinstance(e, zipfile.BadZipFile) else f"{type(e).__name__}"
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            return f"entry {info.filename[:80]!r} is compressed ({info.compress_size} bytes for " \
                   f"{info.file_size})"
    if sum(i.file_size for i in infos) > len(payload):
        return "its entries declare more bytes than it holds"
    return None


def distinct_elements(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view of ``size`` and ``stride`` maps distinct indices to distinct storage
    elements (no stride 0 along a dim of more than one element, no overlapping rows): the dims
    sorted by stride, each stride at least the extent of those inside it."""
    if 0 in size:
        return True
    dims = sorted((s, n) for s, n in zip(stride, size, strict=True) if n > 1)
    extent = 1
    for s, n in dims:
        if s < extent:
            return False
        extent = s * n
    return True
