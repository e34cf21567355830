"""A save's frozen file, or a reference to the previous checkpoint's (docs/FORMAT.md section 15).

Where the bytes of this save's frozen file are those of the previous checkpoint's frozen file
(same slots, same CRC32C of the file they would make), the manifest references that file instead
of writing it again: decided from the bytes in memory and the previous manifest, reading no old
file. Used by :class:`~shardckpt.training.save_load.SaveJob` for each shard it writes.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from shardckpt.checkpoint.reader import as_storage, read_manifest
from shardckpt.checkpoint.references import RunFiles, reference_to
from shardckpt.checkpoint.run_dir import STEP_DIR
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.errors import ShardckptError
from shardckpt.format.manifest import FileEntry, frozen_part
from shardckpt.storage import Storage

log = logging.getLogger(__name__)


def write_frozen(writer: CheckpointWriter, shard: int, produce: Any, previous: str | None) -> FileEntry:
    """Shard ``shard``'s frozen file through ``writer``, or, where its bytes are those of the
    frozen file of ``previous`` (the run's previous committed checkpoint, a sibling), a
    reference to that file."""
    storage, spec = writer.storage, writer.spec
    prev = previous_frozen(storage, spec, shard, previous)
    if prev is not None:
        pieces = [memoryview(p).cast("B") for slot in writer.frozen_slots for p in produce(slot)]
        size, header_size, crc = writer.frozen_crc(shard, pieces)
        entry, step = prev
        path = reference_to(entry, step)
        if ((size, header_size, crc) == (entry.size, entry.header_size, entry.crc32c)
                and (entry.digest is not None and entry.algorithm == spec.digest_algorithm
                     or not spec.with_digests)
                and still_there(storage, path, size)):
            log.debug("%s: frozen shard %d unchanged; referencing %s", storage.url, shard, path)
            return replace(entry, path=path, digest=entry.digest if spec.with_digests else None)
        del pieces
    return writer.write_frozen(shard, produce)


def still_there(storage: Storage, path: str, size: int) -> bool:
    """Whether the file a reference would name is there with its size (a checkpoint it lies
    in may have been removed since the previous manifest named it): else it is written."""
    try:
        return RunFiles(storage).size(path) == size
    except ShardckptError as e:
        log.info("%s: not referencing %s (%s); writing the frozen file", storage.url, path, e)
        return False


def previous_frozen(storage: Storage, spec: CheckpointSpec, shard: int,
                    previous: str | None) -> tuple[FileEntry, str] | None:
    """(frozen entry of ``shard``, step directory name) of the checkpoint ``previous``, where it
    can stand for this save's (at ``storage``): a sibling step directory whose manifest has the
    same mesh, chunk size and frozen groups (names, dtypes, numel, padding, parameters)."""
    if not previous:
        return None
    here, _, name = storage.url.rstrip("/").rpartition("/")
    there, _, step = previous.rstrip("/").rpartition("/")
    if here != there or step == name or not STEP_DIR.match(step):
        return None
    try:
        m = read_manifest(as_storage(previous, storage.storage_options))
    except ShardckptError as e:
        log.info("%s: the previous checkpoint %s is unreadable (%s); writing the frozen files",
                 storage.url, previous, e)
        return None
    if (not m.frozen or m.mesh != spec.mesh or m.chunk_size != spec.chunk_size
            or frozen_part(m.components) != frozen_part(spec.components)):
        return None
    return m.frozen_file(shard), step
