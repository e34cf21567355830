"""``torch.save`` archives from an author who is not trusted, checked so that reading one holds no
more than the data it yields.

A ``torch.save`` archive is an uncompressed zip: ``<name>/data.pkl`` (the pickle), a few small
records (``byteorder``, ``version``, ...) and one record ``<name>/data/<key>`` per storage. Three
steps, each refusing with one :class:`~shardckpt.errors.IntegrityError` naming the file:

1. :func:`~shardckpt.interop.pt_zip.read_layout`, before torch reads anything: the zip structure
   (:mod:`shardckpt.interop.pt_zip`; a few small reads, whatever the file's size). A sparse tail,
   a record declaring more bytes than the file has, or bytes no record accounts for are refused
   there.
2. :func:`load_mapped`: ``torch.load(weights_only=True, mmap=True)`` of a local file (a remote one
   is first copied to a local temporary file in pieces): storages are mapped, not read; a page
   is read only when a value on it is.
3. :func:`check_tensors`, before any value is read: every tensor is a plain strided CPU tensor of
   an allowed dtype whose elements lie inside its storage, no two of them at the same place (no
   stride 0, no overlapping view); every storage is exactly one record (its declared size that
   record's size, each record used by one storage); and the storages hold at most
   :data:`SLACK_BYTES` + 1/8 more than the tensors' own elements. A tensor can therefore never
   yield more bytes than the file holds for it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any
from collections.abc import Iterator

from shardckpt.errors import IntegrityError
from shardckpt.interop.foreign import shown
from shardckpt.interop.pt_zip import Layout, Record

#: Storage bytes that no tensor's elements occupy, allowed beyond 1/8 of what they do occupy.
SLACK_BYTES = 1 << 20
#: Element types a foreign tensor may have.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
               "uint8", "bool")


# ------------------------------------------------------------------------------- loading


def load_mapped(path: str, url: str, safe_globals: list[Any]) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)`` with ``safe_globals`` allowed, tensors on
    the CPU, their storages mapped from the file (read only where a value is)."""
    import torch

    with torch.serialization.safe_globals(safe_globals):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def local_copy(chunks: Iterator[bytes], folder: str | None = None) -> str:
    """A temporary local file holding ``chunks`` (written one piece at a time); the caller
    removes it."""
    fd, path = tempfile.mkstemp(prefix="shardckpt-pt-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in chunks:
                f.write(piece)
    except BaseException:
        os.unlink(path)
        raise
    return path


# ------------------------------------------------------------------------------ checking


def walk_tensors(obj: Any) -> Iterator[tuple[str, Any]]:
    """(key path, tensor) for every tensor in ``obj`` (dicts, lists, tuples and the inert
    stand-ins' fields; each container visited once, without recursion)."""
    import torch

    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, torch.Tensor):
            yield where or "top level", v
            continue
        if isinstance(v, (str, bytes, int, float, bool)) or v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            items = list(v.items())
            stack.extend((x, f"{where}.{_key(k)}" if where else _key(k)) for k, x in reversed(items))
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend((x, f"{where}[{i}]") for i, x in reversed(list(enumerate(v))))
        elif hasattr(v, "__dict__"):
            stack.extend((x, f"{where}.{k}" if where else k)
                         for k, x in reversed(list(vars(v).items())))


def _key(k: Any) -> str:
    s = k if isinstance(k, str) else repr(k)
    return s if len(s) <= 80 and s.isprintable() else shown(s, 80)


def _extent(t: Any) -> tuple[int, str | None]:
    """(elements from the storage offset to one past the last element, why the tensor's elements
    overlap or None)."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1)
    reach = 0
    for st, sz in dims:
        if st <= reach:
            return 0, (f"its elements overlap (shape {list(t.shape)}, strides {list(t.stride())}): "
                       "a view that repeats elements")
        reach += (sz - 1) * st
    return reach + 1, None


def check_tensors(obj: Any, layout: Layout, url: str) -> dict[int, Record]:
    """Refuse, before any value is read, a tensor that could yield bytes the file does not hold
    for it (see the module's step 3): one error naming the file and the tensor's key. Returns the
    record of each storage, by its mapped address."""
    import torch

    allowed = {getattr(torch, n) for n in DTYPE_NAMES}
    storages: dict[int, tuple[int, str]] = {}     # data_ptr -> (bytes, first key)
    spans: dict[int, list[tuple[int, int]]] = {}  # data_ptr -> element byte ranges
    for key, t in walk_tensors(obj):
        where = f"{url}: {shown(key, 120)}"
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise IntegrityError(f"{where}: a {t.layout} tensor; only plain dense tensors are read")
        if t.dtype not in allowed:
            raise IntegrityError(f"{where}: dtype {t.dtype} is not one shardckpt imports")
        if t.device.type != "cpu":
            raise IntegrityError(f"{where}: a tensor on {t.device}")
        if t.numel() == 0:
            continue
        n, overlap = _extent(t)
        if overlap is not None:
            raise IntegrityError(f"{where}: {overlap}; refused")
        s = t.untyped_storage()
        k = t.element_size()
        begin, end = t.storage_offset() * k, (t.storage_offset() + n) * k
        if end > s.nbytes():
            raise IntegrityError(f"{where}: shape {list(t.shape)} of {t.dtype} reaches byte {end} "
                                 f"of a storage that holds {s.nbytes()}; refused")
        ptr = s.data_ptr()
        storages.setdefault(ptr, (s.nbytes(), key))
        spans.setdefault(ptr, []).append((begin, begin + t.numel() * k))
    records = _check_storages(storages, layout, url)
    used = total = 0
    for ptr, ranges in spans.items():
        ranges.sort()
        pos = 0
        for a, b in ranges:
            a = max(a, pos)
            if b > a:
                used += b - a
                pos = b
        total += storages[ptr][0]
    if total - used > SLACK_BYTES + used // 8:
        raise IntegrityError(f"{url}: its storages hold {total} bytes, its tensors' elements "
                             f"only {used}; refused (a tensor is a small view of a large "
                             "storage)")
    return records


def _check_storages(storages: dict[int, tuple[int, str]], layout: Layout,
                    url: str) -> dict[int, Record]:
    """Every mapped storage is exactly one storage record of the file, each record one storage."""
    records = layout.storages()
    used = {p: v for p, v in storages.items() if v[0] > 0}
    if not used and not records:
        return {}
    if len(used) != len(records):
        raise IntegrityError(f"{url}: {len(records)} storage records, but its tensors use "
                             f"{len(used)} storages; refused (records no tensor uses, or a "
                             "storage that is not a record)")
    by_start = {r.start: r for r in records}
    base = min(used) - min(r.start for r in records)
    found: dict[int, Record] = {}
    for ptr, (nbytes, key) in used.items():
        r = by_start.get(ptr - base)
        if r is None or r.size != nbytes:
            what = (f"declares {nbytes} bytes, its record {shown(r.name, 80)} holds {r.size}"
                    if r is not None else "is not one of the archive's records")
            raise IntegrityError(f"{url}: {shown(key, 120)}: its storage {what}; refused")
        found[ptr] = r
    return found


def read_storages(obj: Any, records: dict[int, Record], path: str, url: str) -> None:
    """Give every tensor of ``obj`` (checked by :func:`check_tensors`) a storage of its own in
    memory, read from its record with plain reads, so that nothing refers to the file's mapping
    any more: a file truncated later can then only fail a read, never fault a mapped page. Memory
    is the storages' bytes, which :func:`check_tensors` bounded by the tensors' own."""
    import torch

    tensors, seen = [], set()
    for _, t in walk_tensors(obj):
        if id(t) not in seen:
            seen.add(id(t))
            tensors.append((t, t.untyped_storage().data_ptr() if t.numel() else None))
    fresh: dict[int, Any] = {}
    with open(path, "rb") as f, torch.no_grad():
        for t, ptr in tensors:
            if ptr is None:
                t.set_(torch.empty(0, dtype=t.dtype).untyped_storage(), 0, t.shape, t.stride())
                continue
            s = fresh.get(ptr)
            if s is None:
                r = records[ptr]
                buf = torch.empty(r.size, dtype=torch.uint8)
                f.seek(r.start)
                if f.readinto(buf.numpy().data) != r.size:
                    raise IntegrityError(f"{url}: shorter than when it was opened (record "
                                         f"{shown(r.name, 80)}); was it changed while read?")
                s = fresh[ptr] = buf.untyped_storage()
            t.set_(s, t.storage_offset(), t.shape, t.stride())
