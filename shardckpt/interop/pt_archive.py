"""``torch.save`` archives from an author who is not trusted, checked so that reading one holds no
more than the data it yields.

A ``torch.save`` archive is an uncompressed zip: ``<name>/data.pkl`` (the pickle), a few small
records (``byteorder``, ``version``, ...) and one record ``<name>/data/<key>`` per storage. Three
steps, each refusing with one :class:`~shardckpt.errors.IntegrityError` naming the file:

1. :func:`read_layout`, before torch reads anything: the zip's end record, central directory and
   each record's local header (a few small reads, whatever the file's size). The end record ends
   the file; every record is stored, not compressed; every record's bytes lie inside the file,
   none overlapping another and the central directory after them all; the pickle is at most
   :data:`MAX_PICKLE` bytes, the other small records at most :data:`MAX_SMALL`; and the file
   holds nothing else beyond the headers' few bytes per record. A sparse tail, a record declaring
   more bytes than the file has, or bytes no record accounts for are refused here.
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
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterator

from shardckpt.errors import IntegrityError
from shardckpt.interop.foreign import shown

#: Largest pickle accepted (a DeepSpeed file's pickle is its metadata: kilobytes to megabytes).
MAX_PICKLE = 64 << 20
#: Largest record besides the pickle and the storages (``byteorder``, ``version``, ...).
MAX_SMALL = 4096
#: Largest central directory accepted (one entry is about 100 bytes).
MAX_DIRECTORY = 64 << 20
#: Bytes a record's local header may take besides its 30 fixed bytes and name (torch pads each
#: storage to a 64-byte boundary in the extra field; zip64 adds 20), and a data descriptor after it.
MAX_LOCAL_EXTRA = 256
MAX_DESCRIPTOR = 24
#: Storage bytes that no tensor's elements occupy, allowed beyond 1/8 of what they do occupy.
SLACK_BYTES = 1 << 20
#: Element types a foreign tensor may have.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
               "uint8", "bool")

_EOCD = b"PK\x05\x06"
_LOC64 = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF


@dataclass
class Record:
    """One zip record: its name and the bytes ``[start, start + size)`` of the file it holds."""

    name: str
    start: int
    size: int


@dataclass
class Layout:
    """What :func:`read_layout` found: the records by name and the pickle's name."""

    size: int
    records: dict[str, Record] = field(default_factory=dict)
    pickle: str = ""
    prefix: str = ""
    byteorder: str = ""

    def storages(self) -> list[Record]:
        """The storage records (``<prefix>data/<key>``), holding at least one byte."""
        head = self.prefix + "data/"
        return [r for n, r in self.records.items() if n.startswith(head) and r.size > 0]


def _bad(url: str, what: str) -> IntegrityError:
    return IntegrityError(f"{url}: not a readable torch.save file: {what}")


def read_layout(read: Callable[[int, int], bytes], size: int, url: str) -> Layout:
    """Check the zip structure of the ``size``-byte file ``url`` through ``read(start, end)``
    (a few small reads: the end, the central directory, each local header)."""
    if size < 22:
        raise _bad(url, f"{size} bytes is too short for a zip archive")
    tail_at = max(0, size - (22 + _U16))
    tail = read(tail_at, size)
    pos = tail.rfind(_EOCD)
    while pos >= 0 and (pos + 22 > len(tail)
                        or pos + 22 + struct.unpack_from("<H", tail, pos + 20)[0] != len(tail)):
        pos = tail.rfind(_EOCD, 0, pos)
    if pos < 0:
        raise _bad(url, f"no zip end record ends its {size} bytes (damaged, or data after the "
                        "archive)")
    eocd_at = tail_at + pos
    disk, cd_disk, n_disk, count, cd_size, cd_at = struct.unpack_from("<4xHHHHII", tail, pos)
    cd_end = eocd_at
    loc = read(eocd_at - 20, eocd_at) if eocd_at >= 20 else b""
    if loc[:4] == _LOC64:  # torch writes a zip64 end record (and its locator) before the end record
        (z64_at,) = struct.unpack_from("<Q", loc, 8)
        z64 = read(z64_at, z64_at + 56) if 0 <= z64_at <= eocd_at - 20 - 56 else b""
        if z64[:4] != _EOCD64 or z64_at + 12 + struct.unpack_from("<Q", z64, 4)[0] != eocd_at - 20:
            raise _bad(url, f"damaged zip64 end record (at byte {z64_at})")
        disk, cd_disk, n_disk, count, cd_size, cd_at = struct.unpack_from("<16xIIQQQQ", z64)
        cd_end = z64_at
    elif _U16 in (count, n_disk) or _U32 in (cd_size, cd_at):
        raise _bad(url, "a zip64 end record without its locator")
    if disk or cd_disk or n_disk != count:
        raise _bad(url, "a multi-part zip archive")
    if cd_size > MAX_DIRECTORY:
        raise _bad(url, f"a central directory of {cd_size} bytes; at most {MAX_DIRECTORY} are "
                        "accepted")
    if cd_at + cd_size != cd_end or count > cd_size // 46:
        raise _bad(url, f"its central directory ([{cd_at}, {cd_at + cd_size}), {count} "
                        f"records) does not end where its end record begins (byte {cd_end})")
    cd = read(cd_at, cd_end)
    if len(cd) != cd_size:
        raise _bad(url, "the file is shorter than its central directory says")
    entries = _central(cd, count, url)
    layout = Layout(size)
    entries.sort(key=lambda e: e[2])
    pos = 0
    for i, (name, stored_size, header_at) in enumerate(entries):
        if header_at != pos and not (0 < header_at - pos <= MAX_DESCRIPTOR and i):
            what = ("overlaps the one before it" if header_at < pos else
                    f"starts at byte {header_at}, {header_at - pos} bytes after the one before "
                    "it ends: bytes no record accounts for")
            raise _bad(url, f"record {shown(name, 80)} {what}")
        head = read(header_at, header_at + 30)
        if len(head) != 30 or head[:4] != _LOCAL:
            raise _bad(url, f"record {shown(name, 80)}: no local header at byte {header_at}")
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        if name_len != len(name.encode("utf-8")) or extra_len > MAX_LOCAL_EXTRA:
            raise _bad(url, f"record {shown(name, 80)}: its local header disagrees with the "
                            "central directory")
        start = header_at + 30 + name_len + extra_len
        if start + stored_size > cd_at:
            raise _bad(url, f"record {shown(name, 80)} declares {stored_size} bytes, which run "
                            f"past its end ({cd_at} bytes of records)")
        layout.records[name] = Record(name, start, stored_size)
        pos = start + stored_size
    if cd_at != pos and not (0 < cd_at - pos <= MAX_DESCRIPTOR and entries):
        raise _bad(url, f"{cd_at - pos} bytes between its last record and its central "
                        "directory that no record accounts for")
    _check_names(layout, url)
    if layout.byteorder:
        r = layout.records[layout.byteorder]
        order = read(r.start, r.start + r.size)
        if order != b"little":
            raise _bad(url, f"byte order {order[:16]!r}; only little-endian archives are read")
    return layout


def _central(cd: bytes, count: int, url: str) -> list[tuple[str, int, int]]:
    """(name, size, local header offset) of each central directory entry."""
    out = []
    seen = set()
    p = 0
    for _ in range(count):
        if cd[p:p + 4] != _CENTRAL or p + 46 > len(cd):
            raise _bad(url, "damaged central directory")
        (flags, method, csize, usize, nlen, elen, clen, header_at) = struct.unpack_from(
            "<8xHH8xIIHHH8xI", cd, p)
        raw_name = cd[p + 46:p + 46 + nlen]
        extra = cd[p + 46 + nlen:p + 46 + nlen + elen]
        p += 46 + nlen + elen + clen
        if p > len(cd):
            raise _bad(url, "damaged central directory")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(url, f"a record name that is not UTF-8 ({raw_name[:40]!r})") from None
        if _U32 in (csize, usize, header_at):
            usize, csize, header_at = _zip64(extra, usize, csize, header_at, name, url)
        if flags & 1 or method != 0 or csize != usize:
            raise _bad(url, f"record {shown(name, 80)} is compressed or encrypted; torch.save "
                            "stores every record as it is")
        if name in seen:
            raise _bad(url, f"record {shown(name, 80)} appears twice")
        seen.add(name)
        out.append((name, usize, header_at))
    if p != len(cd):
        raise _bad(url, "damaged central directory (bytes after its last entry)")
    return out


def _zip64(extra: bytes, usize: int, csize: int, header_at: int, name: str,
           url: str) -> tuple[int, int, int]:
    q = 0
    while q + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, q)
        if tag == 1:
            body, values = extra[q + 4:q + 4 + n], list[int]()
            for v in (usize, csize, header_at):
                if v == _U32:
                    if len(body) < 8 * (len(values) + 1):
                        break
                    values.append(struct.unpack_from("<Q", body, 8 * len(values))[0])
                else:
                    values.append(v)
            if len(values) == 3:
                return values[0], values[1], values[2]
            break
        q += 4 + n
    raise _bad(url, f"record {shown(name, 80)}: damaged zip64 sizes")


def _check_names(layout: Layout, url: str) -> None:
    pickles = [n for n in layout.records if n.endswith("data.pkl") and n.count("/") <= 1
               and n.rsplit("/", 1)[-1] == "data.pkl"]
    if len(pickles) != 1:
        raise _bad(url, "no data.pkl record" if not pickles else "two data.pkl records")
    layout.pickle = pickles[0]
    layout.prefix = layout.pickle[:-len("data.pkl")]
    head = layout.prefix + "data/"
    for n, r in layout.records.items():
        if not n.startswith(layout.prefix):
            raise _bad(url, f"record {shown(n, 80)} lies outside the archive's folder "
                            f"{shown(layout.prefix, 80)}")
        if n == layout.pickle:
            if r.size > MAX_PICKLE:
                raise _bad(url, f"a pickle of {r.size} bytes; at most {MAX_PICKLE} are accepted")
        elif not n.startswith(head) and r.size > MAX_SMALL:
            raise _bad(url, f"record {shown(n, 80)} holds {r.size} bytes; a record other than "
                            f"the pickle and the storages holds at most {MAX_SMALL}")
        elif n == layout.prefix + "byteorder":
            layout.byteorder = n


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
