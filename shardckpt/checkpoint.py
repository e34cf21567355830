"""Read and write checkpoints in the shardckpt format, through :mod:`shardckpt.storage`.

``CheckpointWriter`` streams shard files (header first, tensors in manifest order, checksums as bytes
go by) and commits by creating ``manifest.json`` last, create-only. ``CheckpointReader`` opens a
committed checkpoint, refuses one without a manifest, and reads any byte range of any state with
its chunk checksums checked. ``verify`` re-reads everything and lists every problem.
"""

from __future__ import annotations

import datetime as _dt
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Mapping

from shardckpt import commit as _commit
from shardckpt.errors import (
    IncompleteCheckpointError, IntegrityError, ManifestError, ShardckptError, StorageError,
)
from shardckpt.chunked import ROLE as CHUNKS_ROLE, ChunkedSection
from shardckpt.layout import Mesh, itemsize
from shardckpt.lease import DEFAULT_TTL_S, Lease
from shardckpt.manifest import (
    CHUNKED_VERSION, DEFAULT_CHUNK_SIZE, MANIFEST_NAME, MAX_MANIFEST_BYTES, VERSION, Component,
    FileEntry, Manifest, OptimizerInfo, TensorSlot, buffer_slots, chunked_slots, parse, shard_slots,
    to_json,
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
    chunked: ChunkedSection | None = None  # chunked tensors and blobs (format 1.2)


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

    def write_chunks(self, rank: int, slots: list[TensorSlot], produce: Producer) -> FileEntry:
        """Stream one rank's file of chunked tensors and blobs (``slots`` named as
        :func:`shardckpt.chunked.chunk_name` / ``blob_name`` give, in byte order)."""
        v = CHUNKED_VERSION
        return self._stream(f"{self.save_id}/chunks-{rank:05d}.safetensors", CHUNKS_ROLE, rank,
                            slots, produce, {"rank": str(rank), "version": f"{v[0]}.{v[1]}"})

    def manifest(self, files: Iterable[FileEntry]) -> Manifest:
        created = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        order = {"shard": 0, "buffers": 1, "rank": 2, CHUNKS_ROLE: 3}
        entries = sorted(files, key=lambda f: (order[f.role], f.index or 0, f.path))
        s = self.spec
        return Manifest(VERSION if s.chunked is None else CHUNKED_VERSION, self.save_id, created,
                        s.mesh, s.chunk_size, dict(s.components), s.optimizer, dict(s.extras),
                        dict(s.per_rank_state), tuple(entries), s.chunked)

    def data_bytes(self) -> int:
        """About the bytes of the shard and buffer files this save writes (headers aside)."""
        shard = self.slots[-1].end if self.slots else 0
        buffers = self.buffer_slots[-1].end if self.buffer_slots else 0
        return shard * self.spec.mesh.shard_degree + buffers

    def lease(self, ttl_s: float = DEFAULT_TTL_S, hold: bool = True) -> "Lease | nullcontext[None]":
        """A context manager holding this attempt's lease while it writes and commits, so that
        ``shardckpt clean`` leaves the attempt's directory alone whatever its age. Where several
        processes write one attempt, the one that commits holds it (``hold=False`` elsewhere)."""
        return Lease(self.storage, self.save_id, ttl_s) if hold else nullcontext()

    def commit(self, files: Iterable[FileEntry], replacing: bytes | None = None) -> Manifest:
        """Commit the save: call once, after every file is durable.

        Every file the manifest names must be there with its size (else
        :class:`IncompleteCheckpointError`, nothing committed); local directories are synced;
        then ``manifest.json`` is created, create-only. With ``replacing`` (the bytes of the
        manifest there when the save began), that manifest is replaced instead, only if it is
        still there unchanged, and read back (:func:`shardckpt.commit.replace`).
        """
        m = self.manifest(files)
        data = to_json(m)
        parse(data, self.storage.url_of(MANIFEST_NAME))  # never commit what we could not read back
        _commit.check_files(self.storage, m)
        _commit.sync_dirs(self.storage, self.save_id)
        if replacing is None:
            self.storage.create_only(MANIFEST_NAME, data)
        else:
            _commit.replace(self.storage, data, replacing, self.save_id)
        log.info("committed %s (%d files, %d bytes)", self.storage.url, len(m.files), m.total_bytes)
        return m

    def discard(self) -> bool:
        """After a failure, with the lease released: remove this attempt's directory, unless the
        manifest there names it (then it is the checkpoint, not debris).

        Returns False where the directory could not be removed; ``shardckpt clean`` removes it.
        """
        try:
            if f"save {self.save_id}" == _commit.save_id_of(_commit.current_manifest(self.storage)):
                return True
            self.storage.rm(self.save_id, recursive=True)
        except ShardckptError as e:
            log.warning("could not remove %s (%s)", self.storage.url_of(self.save_id), e)
            return False
        return True


class CheckpointReader:
    """A committed checkpoint: its manifest, and checked ranged reads of any state.

    Before the first read of a shard or buffers file, its safetensors header is read once (its
    chunks CRC-checked) and every tensor it places must be where the manifest's slots say
    (:meth:`check_file`); so a manifest that disagrees with the files it names is refused by
    every tool, not only by ``verify``.
    """

    def __init__(self, location: "str | Storage", storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage = as_storage(location, storage_options)
        self.manifest = read_manifest(self.storage)
        m = self.manifest
        self.slots = {s.name: s for s in shard_slots(m.components, m.mesh, m.version)}
        self.buffer_slots = {s.name: s for s in buffer_slots(m.components)}
        self._headers: dict[str, IntegrityError | None] = {}  # path -> None (agrees) or the error
        self._headers_lock = threading.Lock()

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
        if entry.role not in ("shard", "buffers", CHUNKS_ROLE):
            return
        with self._headers_lock:
            done = entry.path in self._headers
            err = self._headers.get(entry.path)
        if not done:
            url = self.storage.url_of(entry.path)
            want = expected_slots(self.manifest, entry, self.slots, self.buffer_slots)
            head = self.storage.read(entry.path, 0, entry.data_start)
            problems = _check_header(url, entry, head, entry.size, want)
            if problems:  # raises IntegrityError naming the chunk if the bytes are damaged
                head = bytes(self.storage.read_checked(entry, self.manifest.chunk_size, 0, entry.data_start))
                problems = _check_header(url, entry, head, entry.size, want)
            err = IntegrityError("; ".join(problems)) if problems else None
            with self._headers_lock:
                self._headers[entry.path] = err
        if err is not None:
            raise err

    def slot(self, group: str, kind: str) -> TensorSlot:
        try:
            return self.slots[f"{group}.{kind}"]
        except KeyError:
            raise ManifestError(f"{self.storage.url_of(MANIFEST_NAME)}: no state {kind!r} for "
                                f"group {group!r}") from None

    def state_range(self, shard: int, group: str, kind: str, start: int, end: int) -> tuple[FileEntry, int, int]:
        """File and absolute byte range of elements ``[start, end)`` of a shard's state (the
        file's header checked against the manifest first, see :meth:`check_file`)."""
        s = self.slot(group, kind)
        n = itemsize(s.dtype)
        entry = self.manifest.shard_file(shard)
        self.check_file(entry)
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
        for entry in {e.path: e for e, _, _ in requests}.values():
            self.check_file(entry)
        return self.storage.read_checked_many(requests, self.manifest.chunk_size, workers=workers)

    def read_buffer(self, fqn: str) -> tuple[TensorSlot, memoryview]:
        entry = self.manifest.buffers_file()
        s = self.buffer_slots.get(fqn)
        if entry is None or s is None:
            raise ManifestError(f"{self.storage.url}: no buffer {fqn!r}")
        self.check_file(entry)
        return s, self.storage.read_checked(entry, self.manifest.chunk_size,
                                            entry.data_start + s.begin, entry.data_start + s.end)


def read_manifest(storage: Storage) -> Manifest:
    """Load and validate ``manifest.json``; a missing one means the save never committed.

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
    return parse(data, url)


# ------------------------------------------------------------------------------------ verify


@dataclass(frozen=True)
class FileReport:
    path: str
    size: int
    ok: bool
    problems: tuple[str, ...]


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify` found. True exactly when every check held.

    ``problems`` lists every problem: the manifest's (then ``manifest`` is None and there are
    no reports), then each file's, in manifest order.
    """

    url: str
    manifest: Manifest | None
    reports: tuple[FileReport, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems

    def __bool__(self) -> bool:
        return self.ok


def verify(location: "str | Storage", storage_options: Mapping[str, Any] | None = None,
           workers: int = 4, progress: Callable[[int], None] | None = None,
           manifest: "Manifest | ShardckptError | None" = None,
           paths: "Collection[str] | None" = None) -> VerifyResult:
    """Check every file against the manifest: presence, size, whole and per-chunk CRC32C, header.

    Never stops at the first problem. ``progress(nbytes)`` is called as bytes are checked.
    Memory is bounded by the chunk size times ``workers``. ``manifest``: the manifest already
    read by the caller with :func:`read_manifest` (or the error that gave), so that it is not
    read twice. ``paths``: check only these of the manifest's files (a ``torchrun`` job's share:
    :func:`shardckpt.distributed_tools.verify_job` splits the files over the job's processes).
    """
    storage = as_storage(location, storage_options)
    if manifest is None:
        try:
            manifest = read_manifest(storage)
        except ShardckptError as e:
            manifest = e
    if isinstance(manifest, ShardckptError):
        return VerifyResult(storage.url, None, (), (str(manifest),))
    m = manifest
    expected = {"shard": shard_slots(m.components, m.mesh, m.version), "buffers": buffer_slots(m.components)}
    expected.update({f.path: chunked_slots(m, f.path) for f in m.files if f.role == CHUNKS_ROLE})

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
        problems += _check_header(url, entry, head, actual,
                                  expected.get(entry.path if entry.role == CHUNKS_ROLE else entry.role))
        return FileReport(entry.path, entry.size, not problems, tuple(problems))

    with ThreadPoolExecutor(max(1, workers)) as pool:
        reports = tuple(pool.map(check, [f for f in m.files if paths is None or f.path in paths]))
    return VerifyResult(storage.url, m, reports, tuple(p for r in reports for p in r.problems))


def expected_slots(m: Manifest, entry: FileEntry, shard: Mapping[str, TensorSlot],
                   buffers: Mapping[str, TensorSlot]) -> list[TensorSlot]:
    """The tensors the manifest places in shard, buffers or chunks file ``entry``."""
    if entry.role == CHUNKS_ROLE:
        return chunked_slots(m, entry.path)
    return list((shard if entry.role == "shard" else buffers).values())


def _check_header(url: str, entry: FileEntry, head: bytes, actual_size: int,
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
