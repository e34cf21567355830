"""Read and write checkpoints in the shardckpt format, through :mod:`shardckpt.storage`.

``CheckpointWriter`` streams shard files (header first, tensors in manifest order, checksums as bytes
go by) and commits by creating ``manifest.json`` last, create-only. ``CheckpointReader`` opens a
committed checkpoint, refuses one without a manifest, and reads any byte range of any state with
its chunk checksums checked. ``verify`` re-reads everything and lists every problem.
"""

from __future__ import annotations

import datetime as _dt
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from shardckpt.errors import (
    IncompleteCheckpointError, IntegrityError, ManifestError, ShardckptError, StorageError,
)
from shardckpt.layout import Mesh, itemsize
from shardckpt.manifest import (
    DEFAULT_CHUNK_SIZE, MANIFEST_NAME, MAX_MANIFEST_BYTES, VERSION, Component, FileEntry, Manifest,
    OptimizerInfo, TensorSlot, buffer_slots, parse, shard_slots, to_json,
)
from shardckpt.stheader import build_header, header_length, parse_header
from shardckpt.storage import NotFoundError, Storage, crc32c, iter_file_chunks

log = logging.getLogger(__name__)

Producer = Callable[[TensorSlot], Iterable[Any]]


def new_save_id() -> str:
    """Unique per save attempt: a UTC timestamp and 8 random hex digits."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


def shard_file_name(save_id: str, shard: int, shard_degree: int) -> str:
    return f"{save_id}/shard-{shard:05d}-of-{shard_degree:05d}.safetensors"


def as_storage(location: "str | Storage", storage_options: Mapping[str, Any] | None = None) -> Storage:
    return location if isinstance(location, Storage) else Storage(location, storage_options)


@dataclass
class CheckpointSpec:
    """Everything a manifest says except its files: what a writer is asked to write."""

    mesh: Mesh
    components: Mapping[str, Component]
    optimizer: OptimizerInfo | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    per_rank_state: Mapping[str, Any] = field(default_factory=dict)
    chunk_size: int = DEFAULT_CHUNK_SIZE


class CheckpointWriter:
    """Writes the files of one save attempt below ``storage`` and commits them.

    Each shard rank's file may be written by a different process: construct a writer with the
    same ``spec`` and ``save_id`` everywhere, write your files, gather the :class:`FileEntry`
    results to one process, and call :meth:`commit` there once every file is durable.
    """

    def __init__(self, storage: Storage, spec: CheckpointSpec, save_id: str | None = None) -> None:
        self.storage = storage
        self.spec = spec
        self.save_id = save_id or new_save_id()
        self.slots = shard_slots(spec.components, spec.mesh)
        self.buffer_slots = buffer_slots(spec.components)

    def _stream(self, rel: str, role: str, index: int | None, slots: list[TensorSlot],
                produce: Producer, meta: dict[str, str]) -> FileEntry:
        header = build_header(slots, {"format": "shardckpt", "version": f"{VERSION[0]}.{VERSION[1]}",
                                      "save_id": self.save_id, **meta})
        with self.storage.writer(rel, self.spec.chunk_size) as w:
            w.write(header)
            for slot in slots:
                expected = slot.end - slot.begin
                got = 0
                for piece in produce(slot):
                    view = memoryview(piece).cast("B")
                    got += len(view)
                    if got > expected:
                        raise ShardckptError(f"{self.storage.url_of(rel)}: producer gave more than "
                                             f"{expected} bytes for {slot.name}")
                    w.write(view)
                if got != expected:
                    raise ShardckptError(f"{self.storage.url_of(rel)}: producer gave {got} of "
                                         f"{expected} bytes for {slot.name}")
            size, crc, chunks = w.close()
        return FileEntry(rel, role, size, len(header) - 8, crc, chunks, index)

    def write_shard(self, shard: int, produce: Producer) -> FileEntry:
        """Stream shard ``shard``: ``produce(slot)`` yields the bytes of each ``<group>.<kind>``."""
        S = self.spec.mesh.shard_degree
        rel = shard_file_name(self.save_id, shard, S)
        return self._stream(rel, "shard", shard, self.slots, produce,
                            {"shard": str(shard), "shard_degree": str(S)})

    def write_buffers(self, produce: Producer) -> FileEntry | None:
        if not self.buffer_slots:
            return None
        return self._stream(f"{self.save_id}/buffers.safetensors", "buffers", None,
                            self.buffer_slots, produce, {})

    def write_rank_state(self, rank: int, slots: list[TensorSlot], produce: Producer) -> FileEntry:
        return self._stream(f"{self.save_id}/rank-{rank:05d}.safetensors", "rank", rank, slots,
                            produce, {"rank": str(rank)})

    def manifest(self, files: Iterable[FileEntry]) -> Manifest:
        created = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        order = {"shard": 0, "buffers": 1, "rank": 2}
        entries = sorted(files, key=lambda f: (order[f.role], f.index or 0, f.path))
        s = self.spec
        return Manifest(VERSION, self.save_id, created, s.mesh, s.chunk_size, dict(s.components),
                        s.optimizer, dict(s.extras), dict(s.per_rank_state), tuple(entries))

    def commit(self, files: Iterable[FileEntry]) -> Manifest:
        """Create ``manifest.json`` (create-only). Call once, after every file is durable."""
        m = self.manifest(files)
        data = to_json(m)
        parse(data, self.storage.url_of(MANIFEST_NAME))  # never commit what we could not read back
        self.storage.create_only(MANIFEST_NAME, data)
        log.info("committed %s (%d files, %d bytes)", self.storage.url, len(m.files), m.total_bytes)
        return m


class CheckpointReader:
    """A committed checkpoint: its manifest, and checked ranged reads of any state."""

    def __init__(self, location: "str | Storage", storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage = as_storage(location, storage_options)
        self.manifest = read_manifest(self.storage)
        m = self.manifest
        self.slots = {s.name: s for s in shard_slots(m.components, m.mesh, m.version)}
        self.buffer_slots = {s.name: s for s in buffer_slots(m.components)}

    @property
    def url(self) -> str:
        return self.storage.url

    def slot(self, group: str, kind: str) -> TensorSlot:
        try:
            return self.slots[f"{group}.{kind}"]
        except KeyError:
            raise ManifestError(f"{self.storage.url_of(MANIFEST_NAME)}: no state {kind!r} for "
                                f"group {group!r}") from None

    def state_range(self, shard: int, group: str, kind: str, start: int, end: int) -> tuple[FileEntry, int, int]:
        """File and absolute byte range of elements ``[start, end)`` of a shard's state."""
        s = self.slot(group, kind)
        n = itemsize(s.dtype)
        entry = self.manifest.shard_file(shard)
        base = entry.data_start + s.begin
        if not 0 <= start <= end <= s.shape[0]:
            raise IntegrityError(f"{self.storage.url_of(entry.path)}: elements [{start}, {end}) are "
                                 f"outside {s.name} ({s.shape[0]} elements)")
        return entry, base + start * n, base + end * n

    def read_state(self, shard: int, group: str, kind: str, start: int = 0,
                   end: int | None = None) -> memoryview:
        s = self.slot(group, kind)
        entry, a, b = self.state_range(shard, group, kind, start, s.shape[0] if end is None else end)
        return self.storage.read_checked(entry, self.manifest.chunk_size, a, b)

    def read_ranges(self, requests: list[tuple[FileEntry, int, int]], workers: int = 8) -> list[memoryview]:
        return self.storage.read_checked_many(requests, self.manifest.chunk_size, workers=workers)

    def read_buffer(self, fqn: str) -> tuple[TensorSlot, memoryview]:
        entry = self.manifest.buffers_file()
        s = self.buffer_slots.get(fqn)
        if entry is None or s is None:
            raise ManifestError(f"{self.storage.url}: no buffer {fqn!r}")
        return s, self.storage.read_checked(entry, self.manifest.chunk_size,
                                            entry.data_start + s.begin, entry.data_start + s.end)


def read_manifest(storage: Storage) -> Manifest:
    """Load and validate ``manifest.json``; a missing one means the save never committed."""
    url = storage.url_of(MANIFEST_NAME)
    try:
        size = storage.size(MANIFEST_NAME)
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{url}: {size} bytes; a manifest of more than {MAX_MANIFEST_BYTES} "
                                "bytes is refused before it is read")
        data = storage.read(MANIFEST_NAME)
    except NotFoundError:
        if not storage.exists(""):
            raise IncompleteCheckpointError(f"{storage.url}: no such checkpoint (nothing is there)") from None
        raise IncompleteCheckpointError(
            f"{storage.url} has no {MANIFEST_NAME}; the save never committed (or this is not a "
            "shardckpt checkpoint). Resume from an earlier checkpoint.") from None
    return parse(data, url)


# ------------------------------------------------------------------------------------ verify


@dataclass(frozen=True)
class FileReport:
    path: str
    size: int
    ok: bool
    problems: tuple[str, ...]


def verify(location: "str | Storage", storage_options: Mapping[str, Any] | None = None,
           workers: int = 4, progress: Callable[[int], None] | None = None) -> tuple[Manifest | None, list[FileReport], list[str]]:
    """Check every file against the manifest: presence, size, whole and per-chunk CRC32C, header.

    Returns (manifest, per-file reports, checkpoint-level problems); never stops at the first
    problem. ``progress(nbytes)`` is called as bytes are checked. Memory is bounded by the chunk size
    times ``workers``.
    """
    storage = as_storage(location, storage_options)
    try:
        m = read_manifest(storage)
    except ShardckptError as e:
        return None, [], [str(e)]
    expected = {"shard": shard_slots(m.components, m.mesh, m.version), "buffers": buffer_slots(m.components)}

    def check(entry: FileEntry) -> FileReport:
        url = storage.url_of(entry.path)
        problems: list[str] = []
        try:
            actual = storage.size(entry.path)
        except NotFoundError:
            return FileReport(entry.path, entry.size, False, (f"{url}: missing",))
        except StorageError as e:
            return FileReport(entry.path, entry.size, False, (str(e),))
        if actual != entry.size:
            what = "truncated" if actual < entry.size else "extended"
            problems.append(f"{url}: {what}: {actual} bytes, the manifest records {entry.size}")
        crc, i, head = 0, 0, b""
        bad_chunks = []
        try:
            for data in iter_file_chunks(storage, entry.path, m.chunk_size, limit=entry.size):
                crc = crc32c(data, crc)
                if i < len(entry.chunk_crc32c) and crc32c(data) != entry.chunk_crc32c[i]:
                    bad_chunks.append(i)
                if len(head) < 8 + entry.header_size:
                    head += data[: 8 + entry.header_size - len(head)]
                i += 1
                if progress:
                    progress(len(data))
        except StorageError as e:
            problems.append(str(e))
            return FileReport(entry.path, entry.size, False, tuple(problems))
        if bad_chunks:
            spans = ", ".join(f"[{c * m.chunk_size}, {min(entry.size, (c + 1) * m.chunk_size)})"
                              for c in bad_chunks[:5])
            problems.append(f"{url}: {len(bad_chunks)} chunk(s) fail their CRC32C check (bytes {spans}"
                            f"{', ...' if len(bad_chunks) > 5 else ''}); the file is corrupted")
        elif actual == entry.size and crc != entry.crc32c:
            problems.append(f"{url}: whole-file CRC32C {crc:08x} differs from the recorded {entry.crc32c:08x}")
        problems += _check_header(url, entry, head, actual, expected.get(entry.role))
        return FileReport(entry.path, entry.size, not problems, tuple(problems))

    with ThreadPoolExecutor(max(1, workers)) as pool:
        reports = list(pool.map(check, m.files))
    return m, reports, []


def _check_header(url: str, entry: FileEntry, head: bytes, actual_size: int,
                  slots: list[TensorSlot] | None) -> list[str]:
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
    if set(tensors) != set(want):
        missing = sorted(set(want) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(want))[:5]
        return [f"{url}: header tensors differ from the manifest (missing {missing}, unexpected {extra})"]
    bad = [name for name, s in want.items() if tensors[name] != s]
    if bad:
        return [f"{url}: header places {', '.join(bad[:5])} differently from the manifest"]
    return []
