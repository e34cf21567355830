"""A node-local save on its way (:class:`LocalSave`: written to the node directories, not yet
copied to peers or committed), and its copy to the durable tier from those directories
(:func:`copy_to_durable`), for :class:`~shardckpt.training.tiers.NodeTier`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.attempt import Attempt, Steps
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.loss_flag import LossFlag
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.references import RunFiles
from shardckpt.checkpoint.run_dir import step_dir
from shardckpt.checkpoint.tiers import durable_references
from shardckpt.checkpoint.writer import CheckpointWriter
from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import FileEntry, Manifest, frozen_file_name
from shardckpt.storage import Storage, iter_file_chunks

log = logging.getLogger(__name__)

COPY_PIECE = 8 << 20


@dataclass
class LocalSave:
    """A save written to the node directories, not yet copied to peers or committed."""

    step: int
    writer: CheckpointWriter
    by_rank: dict[int, list[FileEntry]]  # the files each rank wrote

    @property
    def entries(self) -> list[FileEntry]:
        return [e for r in sorted(self.by_rank) for e in self.by_rank[r]]


def copy_to_durable(node: Storage, group: Any, rank: int, save: LocalSave, url: str,
                    storage_options: Mapping[str, Any] | None) -> Manifest:
    """Commit ``save`` at ``url`` from the node directory ``node``: an
    :class:`~shardckpt.checkpoint.attempt.Attempt` over the tier's ``group`` under the save's id,
    whose every agreement is watched (a rank lost on the way fails every survivor at once).
    Its guard, on rank 0: a frozen file whose entry equals the frozen file of the run's latest
    committed durable checkpoint is not copied; the durable manifest references that file
    (decided from the manifests and the referenced files' sizes, reading none of their
    bytes). Its share: each rank streams the files it wrote, checked against what it wrote.
    Rank 0 commits."""
    dst = as_storage(url, storage_options)
    here = node.child(step_dir(save.step))
    chunk = save.writer.spec.chunk_size
    save_id = save.writer.save_id
    # a frozen file the node references in an earlier local step is the durable copy's own
    S, files = save.writer.spec.mesh.shard_degree, RunFiles(here)
    own = {e.path: replace(e, path=frozen_file_name(save_id, e.index or 0, S))
           if e.is_reference else e for e in save.entries}

    def refs() -> dict[str, str]:  # the guard's plan, on every rank once open
        return attempt.guarded or {}

    def copy(_: CheckpointWriter) -> None:
        for e in save.by_rank.get(rank, []):
            d = own[e.path]
            if d.path in refs():
                continue  # referenced in the previous durable checkpoint: not a byte read
            with dst.writer(d.path, chunk) as w:
                for piece in iter_file_chunks(*files.locate(e.path), COPY_PIECE):
                    w.write(piece)
                got = w.close()
            if (got[0], got[1], tuple(got[2])) != (e.size, e.crc32c, tuple(e.chunk_crc32c)):
                raise IntegrityError(f"{files.url_of(e.path)} no longer holds what was written "
                                     f"(size or CRC32C differ); {dst.url} is not committed")

    def entries() -> list[FileEntry]:
        return [replace(e, path=refs()[e.path]) if e.path in refs() else e for e in own.values()]

    job = Job.of_group(group, LossFlag.for_group(group, f"durable/{save_id}"))
    attempt = Attempt(job, url, Steps(f"durable copy plan of {url}", f"save to {url}",
                                      f"commit of {url}"),
                      lambda sid: CheckpointWriter(dst, save.writer.spec, sid), save_id=save_id,
                      guard=lambda: durable_references(dst, save.writer.manifest(own.values())),
                      tell_guard=True, discard=False)
    m = attempt.run(copy, lambda w, _: w.commit(entries()))
    if rank == 0 and refs():
        log.info("durable copy of step %d: %d frozen file(s) referenced in the previous "
                 "checkpoint, not copied", save.step, len(refs()))
    return m or save.writer.manifest(entries())
