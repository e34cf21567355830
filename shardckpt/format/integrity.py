"""The manifest's own integrity: its text encoding, its checksum, bounds on its strings, and the
compact form of the per-chunk checksums it lists.

Pure; no I/O. ``docs/FORMAT.md`` (sections 3.1 and 3.8) specifies what is checked here.

The checksum covers the manifest's bytes as stored, not a re-serialization: the top-level object's
last member is ``"manifest_crc32c": "<8 lowercase hex digits>"``, and the CRC32C covers every byte
before the ``"`` that opens that member's key. A reader never has to reproduce another writer's
number formatting or escaping to check it, and any JSON library can write it (encode the object
without the member, drop the closing ``}``, append ``,`` and the member).
"""

from __future__ import annotations

import json
import re
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any, overload
from collections.abc import Iterable, Iterator, Mapping

from shardckpt.errors import ManifestError

#: The member that holds the manifest's checksum; written by every writer since format 1.1.
CHECKSUM_FIELD = "manifest_crc32c"
#: First format version whose manifests MUST carry :data:`CHECKSUM_FIELD`.
CHECKSUM_SINCE = (1, 1)
#: Longest names, FQNs, units, file paths and alias names (characters).
MAX_NAME = 4096
#: Longest ``save_id``, ``created_at``, ``version``, dtype, state kind, mesh axis and optimizer name.
MAX_SHORT = 256
#: Longest string (value or key) anywhere inside ``extras``, ``hparams`` and ``per_rank_state``.
MAX_FREE = 65536

_BOM = b"\xef\xbb\xbf"
_WS = rb"[ \t\r\n]*"
_TAIL = re.compile(rb'"' + CHECKSUM_FIELD.encode() + rb'"' + _WS + rb":" + _WS
                   + rb'"([0-9a-f]{8})"' + _WS + rb"\}" + _WS + rb"\Z")
#: A ``\uXXXX`` escape of a UTF-16 surrogate: the only way a lone surrogate enters a decoded string.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _crc32c_extension() -> Any:
    """The ``crc32c`` package's C extension (``crc32c._crc32c``), loaded from its file.

    The package's ``__init__`` looks its own version up through ``importlib.metadata`` and loads
    its command line, ~30 ms of every command's start (a third of ``inspect``'s imports); the
    checksum function is the extension's either way. The package itself where that fails (or
    where it is already imported)."""
    if "crc32c" not in sys.modules:
        try:
            import importlib.machinery
            import importlib.util
            import os

            spec = importlib.util.find_spec("crc32c")
            base = (spec.submodule_search_locations or [""])[0] if spec else ""
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = os.path.join(base, "_crc32c" + suffix)
                if base and os.path.exists(path):
                    ext = importlib.util.spec_from_file_location("crc32c._crc32c", path)
                    if ext is not None and ext.loader is not None:
                        mod = importlib.util.module_from_spec(ext)
                        ext.loader.exec_module(mod)
                        return mod
        except (ImportError, OSError):
            pass
    import crc32c as package

    return package


_CRC32C = _crc32c_extension().crc32c


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data``, continuing from ``value``."""
    return _CRC32C(data, value)


def seal(doc: Mapping[str, Any]) -> bytes:
    """Encode the top-level object ``doc`` (``indent=1``) with its checksum as the last member.

    A :data:`CHECKSUM_FIELD` already in ``doc`` is replaced.
    """
    body = {k: v for k, v in doc.items() if k != CHECKSUM_FIELD}
    raw = json.dumps(body, indent=1, allow_nan=False).encode()
    head = raw[:raw.rindex(b"}")].rstrip()
    covered = head + (b"\n " if head.endswith(b"{") else b",\n ")
    return covered + b'"%s": "%08x"\n}' % (CHECKSUM_FIELD.encode(), crc32c(covered))


def decode_text(data: bytes | str, source: str) -> tuple[bytes, str]:
    """The manifest's bytes and text: strict UTF-8, without a byte order mark."""
    if isinstance(data, str):
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ManifestError(f"{source}: not valid manifest JSON: not valid Unicode text "
                                f"({e.reason} at character {e.start})") from e
    else:
        raw = data
    if raw.startswith(_BOM):
        raise ManifestError(f"{source}: not valid manifest JSON: it starts with a UTF-8 byte order "
                            "mark (EF BB BF); a manifest is plain UTF-8 without one")
    if isinstance(data, str):
        return raw, data
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{source}: not valid manifest JSON: not UTF-8 ({e.reason} at byte "
                            f"{e.start})") from e


def check_surrogates(text: str, doc: Any, source: str) -> None:
    """Refuse a string or key anywhere in ``doc`` that holds a lone UTF-16 surrogate.

    Cheap in the common case: only a ``\\uD800``–``\\uDFFF`` escape in ``text`` can produce one,
    so the document is walked only when such an escape occurs.
    """
    if not _SURROGATE_ESCAPE.search(text):
        return
    where = _find_surrogate(doc, "top level")
    if where is not None:
        raise ManifestError(f"{source}: {where}: a string holds a lone UTF-16 surrogate (an "
                            "unpaired \\uD800-\\uDFFF escape); manifest text must be valid Unicode")


def _find_surrogate(v: Any, where: str) -> str | None:
    stack = [(v, where)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if not _encodes(v):
                return where
        elif isinstance(v, dict):
            for k, x in v.items():
                if not _encodes(k):
                    return f"{where} (a key)"
                stack.append((x, k if where == "top level" else f"{where}.{k}"))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))
    return None


def _encodes(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def free_text_problem(v: Any, where: str) -> tuple[str, str] | None:
    """Where and what for the first string or key too long inside free-form JSON (``extras``,
    ``hparams``, ...), or None when every one is within bounds."""
    stack = [(v, where)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if len(v) > MAX_FREE:
                return where, f"a string of {len(v)} characters; at most {MAX_FREE} are allowed here"
        elif isinstance(v, dict):
            for k, x in v.items():
                if len(k) > MAX_FREE:
                    return where, f"a key of {len(k)} characters; at most {MAX_FREE} are allowed here"
                stack.append((x, f"{where}.{k[:64]}"))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))
    return None


def checksum_problem(raw: bytes, doc: Mapping[str, Any], version: tuple[int, int]) -> str | None:
    """Why the manifest's checksum does not hold, or None when it does (or, before format 1.1,
    when there is none)."""
    if CHECKSUM_FIELD not in doc:
        if version >= CHECKSUM_SINCE:
            return (f"format {version[0]}.{version[1]} requires the {CHECKSUM_FIELD} field and it "
                    "is missing")
        return None
    recorded = doc[CHECKSUM_FIELD]
    if not isinstance(recorded, str) or not re.fullmatch(r"[0-9a-f]{8}", recorded):
        return f"{CHECKSUM_FIELD}: expected 8 lowercase hex digits, found {str(recorded)[:20]!r}"
    at = raw.rfind(b'"' + CHECKSUM_FIELD.encode() + b'"')
    tail = _TAIL.match(raw, at) if at >= 0 and next(reversed(list(doc))) == CHECKSUM_FIELD else None
    if tail is None or tail.group(1).decode() != recorded:
        return (f"{CHECKSUM_FIELD} must be the last member of the top-level object, its key "
                "written without escapes")
    got = crc32c(raw[:at])
    if got != int(recorded, 16):
        return (f"mismatch: the manifest records {recorded}, its bytes give "
                f"{got:08x}; it was changed or damaged after it was written")
    return None


class ChunkCrcs(Sequence[int]):
    """The CRC32C of each chunk of a file, held as 4 bytes per chunk (big-endian): a file of a
    million chunks costs 4 MB here, where a tuple of ints would cost about 36 MB. Immutable;
    equal to any sequence of the same ints."""

    __slots__ = ("_raw",)

    def __init__(self, values: Iterable[int] = ()) -> None:
        if isinstance(values, ChunkCrcs):
            self._raw: bytes = values._raw
            return
        a = array("I", values)  # "I" is 4 bytes wherever CPython runs
        if sys.byteorder == "little":
            a.byteswap()
        self._raw = a.tobytes()

    @classmethod
    def from_hex(cls, text: str) -> ChunkCrcs:
        """From 8 hex digits per chunk (validated by the caller)."""
        out = cls.__new__(cls)
        out._raw = bytes.fromhex(text)
        return out

    def hex(self) -> str:
        return self._raw.hex()

    def __len__(self) -> int:
        return len(self._raw) // 4

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        if isinstance(i, slice):
            return tuple(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("chunk index out of range")
        return int.from_bytes(self._raw[4 * i:4 * i + 4], "big")

    def __iter__(self) -> Iterator[int]:
        return (v for (v,) in struct.iter_unpack(">I", self._raw))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkCrcs):
            return self._raw == other._raw
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._raw)

    def __repr__(self) -> str:
        return f"ChunkCrcs({list(self)!r})" if len(self) <= 8 else f"ChunkCrcs(<{len(self)} chunks>)"
