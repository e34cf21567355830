"""The zip structure of a ``torch.save`` archive from an author who is not trusted, checked before
torch reads anything (step 1 of :mod:`shardckpt.interop.pt_archive`).

A ``torch.save`` archive is an uncompressed zip: ``<name>/data.pkl`` (the pickle), a few small
records (``byteorder``, ``version``, ...) and one record ``<name>/data/<key>`` per storage.
:func:`read_layout` reads the zip's end record, central directory and each record's local header
(a few small reads, whatever the file's size). The end record ends the file; every record is
stored, not compressed; every record's bytes lie inside the file, none overlapping another and the
central directory after them all; the pickle is at most :data:`MAX_PICKLE` bytes, the other small
records at most :data:`MAX_SMALL`; and the file holds nothing else beyond the headers' few bytes
per record. A sparse tail, a record declaring more bytes than the file has, or bytes no record
accounts for are refused with one :class:`~shardckpt.errors.IntegrityError` naming the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from collections.abc import Callable

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
