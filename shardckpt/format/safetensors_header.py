"""safetensors headers: build them for streaming writes, parse them strictly. Pure; no I/O.

A safetensors file is ``u64 little-endian N``, ``N`` bytes of JSON, then the data section. We write
the header ourselves so that a shard can be streamed to storage without holding its tensors in
memory; any safetensors reader opens the result. Parsing refuses what the safetensors library
itself accepts but we must not: duplicate keys (the library keeps the last one).
"""

from __future__ import annotations

import json
import struct
from typing import Any
from collections.abc import Iterable, Mapping

from shardckpt.errors import IntegrityError
from shardckpt.format.dtypes import DTYPES, SAFETENSORS_TO_DTYPE
from shardckpt.format.manifest import TensorSlot
from shardckpt.format.parse_context import no_duplicate_keys

#: Largest header we accept (the safetensors library's own cap).
MAX_HEADER = 100_000_000


def build_header(slots: Iterable[TensorSlot], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length plus JSON header for ``slots`` (padded with spaces to 8-byte alignment)."""
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for s in slots:
        doc[s.name] = {"dtype": DTYPES[s.dtype].safetensors, "shape": list(s.shape),
                       "data_offsets": [s.begin, s.end]}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def header_length(prefix: bytes, file_size: int, source: str) -> int:
    """Read the u64 length from the first 8 bytes and check it against the file size."""
    if len(prefix) < 8 or file_size < 8:
        raise IntegrityError(f"{source}: {file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER:
        raise IntegrityError(f"{source}: header length {n} exceeds the {MAX_HEADER}-byte limit")
    if 8 + n > file_size:
        raise IntegrityError(f"{source}: header length {n} runs past the end of the "
                             f"{file_size}-byte file")
    return n


def parse_header(raw: bytes, file_size: int, source: str) -> tuple[dict[str, TensorSlot], dict[str, str]]:
    """Validate the JSON header ``raw`` (without the 8-byte length) of a ``file_size``-byte file.

    Returns tensors by name (offsets relative to the data section) and the ``__metadata__``.
    Refuses duplicate keys, unknown dtypes, offsets outside the data section, overlaps, holes and
    spans that disagree with shape x dtype.
    """
    try:
        doc = json.loads(raw, object_pairs_hook=no_duplicate_keys)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{source}: malformed safetensors header: {e}") from e
    if not isinstance(doc, dict):
        raise IntegrityError(f"{source}: safetensors header is not a JSON object")
    data_size = file_size - 8 - len(raw)
    meta = doc.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise IntegrityError(f"{source}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorSlot] = {}
    for name, t in doc.items():
        if not isinstance(t, dict):
            raise IntegrityError(f"{source}: tensor {name!r}: entry is not an object")
        code, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if not isinstance(code, str) or code not in SAFETENSORS_TO_DTYPE:
            raise IntegrityError(f"{source}: tensor {name[:200]!r}: unknown dtype "
                                 f"{str(code)[:60]!r}")
        if (not isinstance(shape, list) or len(shape) > 16
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise IntegrityError(f"{source}: tensor {name!r}: invalid shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise IntegrityError(f"{source}: tensor {name!r}: invalid data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end <= data_size:
            raise IntegrityError(f"{source}: tensor {name!r}: data_offsets [{begin}, {end}] lie "
                                 f"outside the {data_size}-byte data section")
        dtype = SAFETENSORS_TO_DTYPE[code]
        n = DTYPES[dtype].itemsize
        for d in shape:
            n *= d
        if n != end - begin:
            raise IntegrityError(f"{source}: tensor {name!r}: shape {shape} of {dtype} needs {n} "
                                 f"bytes, data_offsets span {end - begin}")
        tensors[name] = TensorSlot(name, dtype, tuple(shape), begin, end)
    pos = 0
    for s in sorted(tensors.values(), key=lambda s: (s.begin, s.end)):
        if s.begin != pos:
            what = "overlaps another tensor" if s.begin < pos else f"leaves a hole at byte {pos}"
            raise IntegrityError(f"{source}: tensor {s.name!r} {what}")
        pos = s.end
    if pos != data_size:
        raise IntegrityError(f"{source}: tensors cover {pos} bytes of a {data_size}-byte data section")
    return tensors, meta
