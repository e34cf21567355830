"""Write a checkpoint in the shardckpt format, through :mod:`shardckpt.storage`.

``CheckpointWriter`` streams shard files (header first, tensors in manifest order, checksums as bytes
go by) and commits by creating ``manifest.json`` last, create-only.
"""

from __future__ import annotations

import datetime as _dt
import logging
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Callable, Iterable, Mapping

from shardckpt.storage import commit as _commit
from shardckpt.errors import CommitConflictError, IncompleteCheckpointError, ShardckptError
from shardckpt.format.chunked import ROLE as CHUNKS_ROLE, ChunkedSection
from shardckpt.format.layout import Mesh
from shardckpt.format.digests import SHA256, algorithm_for
from shardckpt.format.signing import SigningKey
from shardckpt.storage import DEFAULT_TTL_S, Lease
from shardckpt.format.manifest import (
    DEFAULT_CHUNK_SIZE, FROZEN_ROLE, MANIFEST_NAME, Component, FileEntry, Manifest, OptimizerInfo,
    TensorSlot, buffer_slots, frozen_file_name, frozen_slots, has_frozen_groups, shard_slots, to_json,
)
from shardckpt.format.manifest_parse import parse
from shardckpt.format.safetensors_header import build_header
from shardckpt.format.versions import file_version, version_for
from shardckpt.storage import ChunkHasher, NotFoundError, Storage
from shardckpt.checkpoint.references import RunFiles, file_crc
from shardckpt.checkpoint.set_aside import supersede

log = logging.getLogger(__name__)


#: ``produce(slot)`` yields the bytes of each slot, in order. A producer that also has
#: ``write_positioned(path, url, header, slots, chunk_size) -> (size, crc, chunk crcs) | None``
#: (:class:`shardckpt.training.device_save.ShardBytes`) writes a local file itself, in parallel.
Producer = Callable[[TensorSlot], Iterable[Any]]


def new_save_id() -> str:
    """Unique per save attempt: a UTC timestamp and 8 random hex digits."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


def shard_file_name(save_id: str, shard: int, shard_degree: int) -> str:
    return f"{save_id}/shard-{shard:05d}-of-{shard_degree:05d}.safetensors"


def shard_header(slots: list[TensorSlot], save_id: str, shard: int, shard_degree: int) -> bytes:
    """The header of shard file ``shard`` of save ``save_id`` (its length does not depend on
    which save id: :func:`new_save_id` gives ids of one length)."""
    return build_header(slots, {"format": "shardckpt", "version": file_version("shard"),
                                "save_id": save_id, "shard": str(shard),
                                "shard_degree": str(shard_degree)})


def frozen_header(slots: list[TensorSlot], shard: int, shard_degree: int) -> bytes:
    """The header of ``frozen`` file ``shard`` (:meth:`CheckpointWriter.frozen_header`)."""
    return build_header(slots, {"format": "shardckpt", "version": file_version(FROZEN_ROLE),
                                "shard": str(shard), "shard_degree": str(shard_degree)})


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
    #: format 1.3: frozen groups' slots go to one ``frozen`` file per shard rank (where there are
    #: frozen groups), which a later checkpoint of the run may reference instead of rewriting
    frozen: bool = False
    #: a digest per file (:mod:`shardckpt.format.digests`), computed as the bytes are written;
    #: implied by ``signing_key``: ``True`` BLAKE3 where the ``blake3`` package imports (format
    #: 1.5), else SHA-256 (1.4); ``"blake3"`` or ``"sha256"`` that one
    digests: bool | str = False
    #: format 1.4: sign the manifest with this Ed25519 key (:mod:`shardckpt.format.signing`)
    signing_key: SigningKey | None = None

    @property
    def with_digests(self) -> bool:
        return bool(self.digests) or self.signing_key is not None

    @property
    def digest_algorithm(self) -> str | None:
        """The algorithm of every file's digest, or None without digests."""
        if not self.with_digests:
            return None
        return algorithm_for(self.digests or True)

    @property
    def frozen_files(self) -> bool:
        """Whether this checkpoint has ``frozen`` files (:attr:`frozen` and a frozen group)."""
        return self.frozen and has_frozen_groups(self.components)


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
        frozen = spec.frozen_files
        self.slots = shard_slots(spec.components, spec.mesh, frozen=frozen)
        self.frozen_slots = frozen_slots(spec.components, spec.mesh) if frozen else []
        self.buffer_slots = buffer_slots(spec.components)
        #: a :class:`~shardckpt.storage.spare.Spare` the shard file's positioned write takes over
        self.spare: Any = None

    def _stream(self, rel: str, role: str, index: int | None, slots: list[TensorSlot],
                produce: Producer, meta: dict[str, str], header: bytes | None = None) -> FileEntry:
        if header is None:
            header = build_header(slots, {"format": "shardckpt", "version": file_version(role),
                                          "save_id": self.save_id, **meta})
        positioned = getattr(produce, "write_positioned", None)  # parallel, on a local disk
        spare = self.spare if role == "shard" else None
        opener = self.storage.write_opener(rel, spare) if positioned is not None else None
        if positioned is not None and opener is not None:
            alg = self.spec.digest_algorithm
            hasher = ChunkHasher(self.spec.chunk_size, alg) if alg is not None else None
            done = positioned(self.storage.full(rel), self.storage.url_of(rel), header, slots,
                              self.spec.chunk_size, opener, hasher)
            if done is not None:
                return FileEntry(rel, role, done[0], len(header) - 8, done[1], done[2], index,
                                 hasher.hexdigest() if hasher is not None else None, alg or SHA256)
        with self.storage.writer(rel, self.spec.chunk_size, self.spec.digest_algorithm) as w:
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
        return FileEntry(rel, role, size, len(header) - 8, crc, chunks, index, w.digest,
                         self.spec.digest_algorithm or SHA256)

    def write_shard(self, shard: int, produce: Producer) -> FileEntry:
        """Stream shard ``shard``: ``produce(slot)`` yields the bytes of each ``<group>.<kind>``."""
        S = self.spec.mesh.shard_degree
        rel = shard_file_name(self.save_id, shard, S)
        return self._stream(rel, "shard", shard, self.slots, produce, {},
                            shard_header(self.slots, self.save_id, shard, S))

    def frozen_header(self, shard: int) -> bytes:
        """The header of ``frozen`` file ``shard``: no save id in it, so that the file of a later
        save whose frozen bytes did not change is byte for byte the same (and its CRC32C too)."""
        return frozen_header(self.frozen_slots, shard, self.spec.mesh.shard_degree)

    def write_frozen(self, shard: int, produce: Producer) -> FileEntry:
        """Stream frozen file ``shard`` (format 1.3): the slots of the frozen groups."""
        rel = frozen_file_name(self.save_id, shard, self.spec.mesh.shard_degree)
        return self._stream(rel, FROZEN_ROLE, shard, self.frozen_slots, produce, {},
                            self.frozen_header(shard))

    def frozen_crc(self, shard: int, pieces: list[memoryview]) -> tuple[int, int, int]:
        """(size, header size, CRC32C) that :meth:`write_frozen` of ``pieces`` (the frozen slots'
        bytes, in order) would give, computed without writing anything."""
        header = self.frozen_header(shard)
        size, crc = file_crc(header, pieces)
        return size, len(header) - 8, crc

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
        :func:`shardckpt.format.chunked.chunk_name` / ``blob_name`` give, in byte order)."""
        return self._stream(f"{self.save_id}/chunks-{rank:05d}.safetensors", CHUNKS_ROLE, rank,
                            slots, produce, {"rank": str(rank)})

    def manifest(self, files: Iterable[FileEntry]) -> Manifest:
        created = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        order = {"shard": 0, FROZEN_ROLE: 1, "buffers": 2, "rank": 3, CHUNKS_ROLE: 4}
        entries = sorted(files, key=lambda f: (order[f.role], f.index or 0, f.path))
        s = self.spec
        return Manifest(version_for(s), self.save_id, created,
                        s.mesh, s.chunk_size, dict(s.components), s.optimizer, dict(s.extras),
                        dict(s.per_rank_state), tuple(entries), s.chunked, s.frozen_files)

    def data_bytes(self) -> int:
        """About the bytes of the shard and buffer files this save writes (headers aside)."""
        shard = self.slots[-1].end if self.slots else 0
        shard += self.frozen_slots[-1].end if self.frozen_slots else 0
        buffers = self.buffer_slots[-1].end if self.buffer_slots else 0
        return shard * self.spec.mesh.shard_degree + buffers

    def lease(self, ttl_s: float = DEFAULT_TTL_S, hold: bool = True) -> Lease | nullcontext[None]:
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
        still there unchanged, and read back (:func:`shardckpt.storage.commit.replace`).
        """
        m = self.manifest(files)
        data = to_json(m, self.spec.signing_key)
        parse(data, self.storage.url_of(MANIFEST_NAME))  # never commit what we could not read back
        # own files below the checkpoint; referenced ones (format 1.3) where they lie
        _commit.check_files(self.storage, replace(m, files=tuple(f for f in m.files if not f.is_reference)))
        self._check_references(m)
        _commit.sync_dirs(self.storage, self.save_id)
        if replacing is None:
            try:
                self.storage.create_only(MANIFEST_NAME, data)
            except CommitConflictError:
                # a manifest that a resume passed over and put aside gives way to this save
                if not supersede(self.storage, data, self.save_id):
                    raise
        else:
            _commit.replace(self.storage, data, replacing, self.save_id)
        log.info("committed %s (%d files, %d bytes)", self.storage.url, len(m.files), m.total_bytes)
        return m

    def _check_references(self, m: Manifest) -> None:
        """Every file ``m`` references in a sibling checkpoint is there with its recorded size
        (else :class:`IncompleteCheckpointError`, nothing committed)."""
        files = RunFiles(self.storage)
        bad = []
        for f in m.references():
            try:
                size = files.size(f.path)
            except NotFoundError:
                bad.append(f"{files.url_of(f.path)} (missing)")
                continue
            if size != f.size:
                bad.append(f"{files.url_of(f.path)} ({size} bytes, the manifest records {f.size})")
        if bad:
            raise IncompleteCheckpointError(
                f"{self.storage.url}: not committed: {len(bad)} referenced file(s) of earlier "
                f"checkpoints are not as recorded: {', '.join(bad[:5])} (removed meanwhile?)")

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
