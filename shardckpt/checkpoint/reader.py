"""Read a committed checkpoint: its manifest, and checked ranged reads of any state.

``CheckpointReader`` refuses a checkpoint without a manifest, checks each file's safetensors header
against the manifest before the first read of it, and reads any byte range of any state with its
chunk checksums checked.
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from shardckpt.errors import (
    IncompleteCheckpointError, IntegrityError, ManifestError,
)
from shardckpt.format.chunked import ROLE as CHUNKS_ROLE
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import Layout
from shardckpt.format.manifest import (
    FROZEN_ROLE, MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, TensorSlot, buffer_slots,
    chunked_slots, frozen_slots, shard_slots,
)
from shardckpt.format.manifest_parse import parse
from shardckpt.format.safetensors_header import header_length, parse_header
from shardckpt.checkpoint.references import RunFiles
from shardckpt.checkpoint.trust import PublicKey, Trust, TrustedFiles, check_manifest, trusted_keys
from shardckpt.storage import REMOTE_READS_IN_FLIGHT, NotFoundError, RangeReader, Storage, pool_map

log = logging.getLogger(__name__)


def as_storage(location: str | Storage, storage_options: Mapping[str, Any] | None = None) -> Storage:
    return location if isinstance(location, Storage) else Storage(location, storage_options)


class CheckpointReader:
    """A committed checkpoint: its manifest, and checked ranged reads of any state.

    Before the first read of a shard or buffers file, its safetensors header is read once (its
    chunks CRC-checked) and every tensor it places must be where the manifest's slots say
    (:meth:`check_file`); so a manifest that disagrees with the files it names is refused by
    every tool, not only by ``verify``.
    """

    def __init__(self, location: str | Storage, storage_options: Mapping[str, Any] | None = None,
                 manifest: Manifest | None = None, trust: Trust | None = None) -> None:
        """``manifest``: the checkpoint's manifest, already read and parsed (by another process
        of the same work, which passes it on), so that it is not read again. ``trust``: the
        public keys of :mod:`shardckpt.checkpoint.trust`; the manifest must be signed by one and
        every file must match its signed digest before its first read (else ``TrustError``)."""
        self.storage = as_storage(location, storage_options)
        keys = trusted_keys(trust)
        if keys is not None or manifest is None:  # a trusted read checks the bytes it read itself
            manifest = read_manifest(self.storage, keys)
        self.manifest = m = manifest
        self.trusted = TrustedFiles(self.storage, m) if keys is not None else None
        self.slots = {s.name: s for s in shard_slots(m.components, m.mesh, m.version, m.frozen)}
        #: format 1.3: the slots of frozen groups, which lie in the ``frozen`` files
        self.frozen_slots = {s.name: s for s in frozen_slots(m.components, m.mesh)} if m.frozen else {}
        self.buffer_slots = {s.name: s for s in buffer_slots(m.components)}
        self._headers: dict[str, IntegrityError | None] = {}  # path -> None (agrees) or the error
        self._headers_lock = threading.Lock()
        #: what every read goes through: the checkpoint's own files and those it references in
        #: sibling checkpoints of its run directory
        self.files = RunFiles(self.storage)
        self.ranges = RangeReader(self.files, m.chunk_size)

    @property
    def url(self) -> str:
        return self.storage.url

    def check_file(self, entry: FileEntry) -> None:
        """Raise :class:`IntegrityError` (naming the file and the tensors) unless the header of
        shard or buffers file ``entry`` places every tensor where the manifest does.

        Costs one ranged read of the header's ``8 + header_size`` bytes per file, once per reader
        (the outcome is remembered, failures included); rank files have no slots and pass. A
        header that agrees cannot mislead, whatever its chunk's checksum; one that disagrees is
        read again with its chunks CRC-checked, so that damage is reported as damage.
        """
        self._check_head(entry, None)

    def check_files(self, entries: Iterable[FileEntry], workers: int = REMOTE_READS_IN_FLIGHT) -> None:
        """:meth:`check_file` of each distinct file of ``entries`` not checked yet, their headers
        read at once on up to ``workers`` threads (on an object store each is a ranged GET: one
        file after the other, a 64-rank checkpoint pays 64 round trips in a row)."""
        with self._headers_lock:
            todo = [e for e in {e.path: e for e in entries}.values() if e.path not in self._headers]
        pool_map(self.check_file, todo, workers)

    def check_header_bytes(self, entry: FileEntry, head: bytes) -> None:
        """:meth:`check_file` of ``entry`` with its first ``entry.data_start`` bytes in hand
        (taken from elsewhere, their chunks' CRC32C checked): nothing is read."""
        self._check_head(entry, head)

    def _check_head(self, entry: FileEntry, given: bytes | None) -> None:
        if self.trusted is not None:
            self.trusted.check(entry)
        if entry.role not in ("shard", "buffers", CHUNKS_ROLE, FROZEN_ROLE):
            return
        with self._headers_lock:
            done = entry.path in self._headers
            err = self._headers.get(entry.path)
        if not done:
            url = self.files.url_of(entry.path)
            want = expected_slots(self.manifest, entry, self.slots, self.buffer_slots, self.frozen_slots)
            head = self.files.read(entry.path, 0, entry.data_start) if given is None else given
            problems = check_header(url, entry, head, entry.size, want)
            if problems and given is None:  # raises IntegrityError naming the chunk if damaged
                head = bytes(self.files.read_checked(entry, self.manifest.chunk_size, 0, entry.data_start))
                problems = check_header(url, entry, head, entry.size, want)
            err = IntegrityError("; ".join(problems)) if problems else None
            with self._headers_lock:
                self._headers[entry.path] = err
        if err is not None:
            raise err

    def slot(self, group: str, kind: str) -> TensorSlot:
        name = f"{group}.{kind}"
        try:
            return self.slots[name] if name in self.slots else self.frozen_slots[name]
        except KeyError:
            raise ManifestError(f"{self.storage.url_of(MANIFEST_NAME)}: no state {kind!r} for "
                                f"group {group!r}") from None

    def param_elements(self, layout: Layout, group: str, offset: int, kind: str, first: int,
                       last: int) -> bytes:
        """Elements ``[first, last)`` of the parameter at ``offset`` of flat group ``group`` (of
        ``layout``), state ``kind``: the pieces of every shard that holds some, checked, joined."""
        g = layout.group(group)
        requests = []
        for s in range(self.manifest.mesh.shard_degree):
            lo, hi = layout.shard_range(g, s)
            a, b = max(lo, offset + first), min(hi, offset + last)
            if a < b:
                requests.append(self.state_range(s, g.name, kind, a - lo, b - lo))
        return b"".join(bytes(v) for v in self.read_ranges(requests))

    def state_range(self, shard: int, group: str, kind: str, start: int, end: int,
                    check: bool = True) -> tuple[FileEntry, int, int]:
        """File and absolute byte range of elements ``[start, end)`` of a shard's state (the
        file's header checked against the manifest first, see :meth:`check_file`, unless
        ``check`` is false: the caller checks it, with :meth:`check_header_bytes`)."""
        s = self.slot(group, kind)
        n = itemsize(s.dtype)
        entry = (self.manifest.shard_file(shard) if s.name in self.slots
                 else self.manifest.frozen_file(shard))
        if check:
            self.check_file(entry)
        base = entry.data_start + s.begin
        if not 0 <= start <= end <= s.shape[0]:
            raise IntegrityError(f"{self.files.url_of(entry.path)}: elements [{start}, {end}) are "
                                 f"outside {s.name} ({s.shape[0]} elements)")
        return entry, base + start * n, base + end * n

    def read_state(self, shard: int, group: str, kind: str, start: int = 0,
                   end: int | None = None) -> memoryview:
        s = self.slot(group, kind)
        entry, a, b = self.state_range(shard, group, kind, start, s.shape[0] if end is None else end)
        return self.files.read_checked(entry, self.manifest.chunk_size, a, b)

    def read_ranges(self, requests: list[tuple[FileEntry, int, int]], workers: int = 8) -> list[memoryview]:
        """Checked ranges in any order (:meth:`~shardckpt.storage.RangeReader.gather`), each
        file's header checked against the manifest first."""
        self.check_files((e for e, _, _ in requests), workers)
        return self.ranges.gather(requests, workers)

    def read_buffer(self, fqn: str) -> tuple[TensorSlot, memoryview]:
        entry = self.manifest.buffers_file()
        s = self.buffer_slots.get(fqn)
        if entry is None or s is None:
            raise ManifestError(f"{self.storage.url}: no buffer {fqn!r}")
        self.check_file(entry)
        return s, self.storage.read_checked(entry, self.manifest.chunk_size,
                                            entry.data_start + s.begin, entry.data_start + s.end)


def read_manifest(storage: Storage, trust: Sequence[PublicKey] | None = None) -> Manifest:
    """Load and validate ``manifest.json``; a missing one means the save never committed. With
    ``trust``, it must be signed by one of those keys (:func:`shardckpt.checkpoint.trust.check_manifest`).

    One bounded read (at most the size limit plus one byte) under one retry deadline: the size a
    listing reports is not trusted (a FIFO or a link to a device reports 0).
    """
    url = storage.url_of(MANIFEST_NAME)
    try:
        data = storage.read_prefix(MANIFEST_NAME, MAX_MANIFEST_BYTES + 1)
    except NotFoundError:
        if not storage.exists(""):
            raise IncompleteCheckpointError(f"{storage.url}: no such checkpoint (nothing is there)") from None
        raise IncompleteCheckpointError(
            f"{storage.url} has no {MANIFEST_NAME}; the save never committed (or this is not a "
            "shardckpt checkpoint). Resume from an earlier checkpoint.") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{url}: more than {MAX_MANIFEST_BYTES} bytes; a larger manifest is "
                            "refused without reading the rest")
    m = parse(data, url)
    if trust is not None:
        check_manifest(data, m, storage.url, trust)
    return m


def expected_slots(m: Manifest, entry: FileEntry, shard: Mapping[str, TensorSlot],
                   buffers: Mapping[str, TensorSlot],
                   frozen: Mapping[str, TensorSlot] | None = None) -> list[TensorSlot]:
    """The tensors the manifest places in shard, buffers, frozen or chunks file ``entry``."""
    if entry.role == CHUNKS_ROLE:
        return chunked_slots(m, entry.path)
    if entry.role == FROZEN_ROLE:
        return list((frozen or {}).values())
    return list((shard if entry.role == "shard" else buffers).values())


def check_header(url: str, entry: FileEntry, head: bytes, actual_size: int,
                  slots: list[TensorSlot] | None) -> list[str]:
    """Problems of a file's header (``head``: its first ``8 + header_size`` bytes) against the
    manifest: its length, its validity, and (for ``slots``) every tensor's name, dtype, shape and
    offsets; every mismatching tensor is named."""
    try:
        n = header_length(head, actual_size, url)
        if n != entry.header_size:
            return [f"{url}: header is {n} bytes, the manifest records {entry.header_size}"]
        tensors, _ = parse_header(head[8:8 + n], actual_size, url)
    except IntegrityError as e:
        return [str(e)]
    if slots is None:
        return []
    want = {s.name: s for s in slots}
    missing = [k for k in want if k not in tensors]
    extra = [k for k in tensors if k not in want]
    bad = [f"{k} (header {_place(tensors[k])}, manifest {_place(s)})"
           for k, s in want.items() if k in tensors and tensors[k] != s]
    if not (missing or extra or bad):
        return []
    parts = []
    if missing:
        parts.append(f"missing from the header: {_names(missing)}")
    if extra:
        parts.append(f"in the header but not the manifest: {_names(extra)}")
    if bad:
        parts.append(f"placed differently: {_names(bad)}")
    return [f"{url}: header tensors differ from the manifest: " + "; ".join(parts)]


def _place(s: TensorSlot) -> str:
    return f"{s.dtype} {list(s.shape)} at [{s.begin}, {s.end})"


def _names(items: list[str], most: int = 10) -> str:
    more = len(items) - most
    return ", ".join(items[:most]) + (f" and {more} more" if more > 0 else "")
