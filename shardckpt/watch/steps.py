"""The steps a pipeline runs on one committed checkpoint, and how each recognises its own output.

Each step function takes a :class:`StepContext` and returns the facts its ``.done`` record keeps
(``output``, ``bytes``, ``identity``). Outputs commit by their own discipline before that record
is written: reshard and copy by a create-only ``manifest.json`` written last, consolidate by its
index written last. A verify, reshard or consolidate step with ``processes`` > 1 runs as a
torchrun job (:mod:`shardckpt.watch.job`), whose rank 0 commits the same way.

When a watcher finds a step's output committed but no ``.done`` record (the previous watcher was
killed between the two), :func:`adopt` decides:

* reshard: the output is adopted when it verifies (every checksum), has the requested world
  size and carries the source's step; copy: when its manifest is byte-for-byte the source's and
  it verifies;
* consolidate: when its index names files that all exist and its provenance names the source's
  save id and the requested dtype (the provenance is written just after the index; without it
  the output is rewritten, which replaces it safely);
* verify and retain have no output of their own: they read or prune, and are run again
  (retain also prunes the outputs earlier steps derived: :mod:`shardckpt.watch.retain`).

An output that is not adopted is replaced (the step runs with ``overwrite``); a damaged or
foreign output never gets a record.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping

from shardckpt.checkpoint.reader import read_manifest

from shardckpt.checkpoint.verify import verify
from shardckpt.errors import IncompleteCheckpointError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from shardckpt.format.records import run_extras
from shardckpt.storage import NotFoundError, Storage
from shardckpt.watch.config import StepSpec

log = logging.getLogger(__name__)

COPY_WINDOW = 8  # checksum chunks per checked read while copying


class StepFailed(ShardckptError):
    """A step ran and did not succeed (a verify that found problems)."""


@dataclass
class StepContext:
    spec: StepSpec
    src: Storage                    # the checkpoint
    manifest: Manifest              # its manifest, read when the checkpoint was found
    checkpoint: str                 # its name: step-XXXXXXXX, checkpoint-N, ...step=N.ckpt
    step: int
    watch: Storage                  # the run directory
    storage_options: Mapping[str, Any]
    is_settled: Callable[[str], bool]  # whether every earlier-step record of a checkpoint exists
    steps: tuple[StepSpec, ...] = ()   # the pipeline's steps (retain prunes their outputs)
    trust: tuple[str, ...] = ()     # the pipeline's: the manifest was checked; verify checks digests
    signing_key: str | None = None  # the pipeline's: reshard signs what it writes

    @property
    def dst(self) -> str | None:
        return self.spec.dst_for(self.step, self.checkpoint)

    def dst_storage(self) -> Storage:
        return Storage(self.dst or "", self.storage_options)


def run_verify(ctx: StepContext) -> dict[str, Any]:
    result = verify(ctx.src, manifest=ctx.manifest, digests=bool(ctx.trust))
    if not result:
        more = f" (and {len(result.problems) - 1} more)" if len(result.problems) > 1 else ""
        raise StepFailed(f"{result.problems[0]}{more}")
    return {"bytes": sum(f.size for f in ctx.manifest.files), "identity": ctx.manifest.save_id}


def run_reshard(ctx: StepContext) -> dict[str, Any]:
    from shardckpt.tools.reshard import reshard

    r = reshard(ctx.src.url, ctx.dst or "", ctx.spec.to or 1, from_=ctx.spec.from_,
                replicate=ctx.spec.replicate, overwrite=True, storage_options=ctx.storage_options,
                signing_key=ctx.signing_key)
    return {"output": ctx.dst, "bytes": r.bytes_written, "identity": r.manifest.save_id}


def run_consolidate(ctx: StepContext) -> dict[str, Any]:
    from shardckpt.tools.consolidate import consolidate
    from shardckpt.tools.consolidate_plan import DEFAULT_MAX_SHARD_SIZE

    r = consolidate(ctx.src.url, ctx.dst or "", dtype=ctx.spec.dtype, overwrite=True,
                    max_shard_size=ctx.spec.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
                    storage_options=ctx.storage_options, copy_from=ctx.spec.copy_from,
                    keep_buffers=ctx.spec.keep_buffers)
    return {"output": ctx.dst, "bytes": r.bytes_written, "identity": ctx.manifest.save_id}


def run_copy(ctx: StepContext) -> dict[str, Any]:
    """Copy every file with checked reads, compare each written file's CRC32C with the manifest's,
    then create the manifest (the same bytes) last: the copy commits as a checkpoint does."""
    dst = ctx.dst_storage()
    m = ctx.manifest
    if m.references():
        raise StepFailed(f"{ctx.src.url}: its manifest references frozen files of earlier "
                         "checkpoints of its run, which a copy would not hold; copy a reshard of "
                         "it instead (a reshard writes every byte)")
    data = ctx.src.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    written = 0
    for entry in m.files:
        window = m.chunk_size * COPY_WINDOW
        with dst.writer(entry.path, m.chunk_size) as w:
            for a in range(0, entry.size, window):
                w.write(ctx.src.read_checked(entry, m.chunk_size, a, min(entry.size, a + window)))
            size, crc, _ = w.close()
        if size != entry.size or crc != entry.crc32c:
            raise IncompleteCheckpointError(f"{dst.url_of(entry.path)}: wrote {size} bytes with "
                                            f"CRC32C {crc:08x}, expected {entry.size} bytes, "
                                            f"{entry.crc32c:08x}")
        written += size
    dst.create_only(MANIFEST_NAME, data)
    return {"output": dst.url, "bytes": written, "identity": m.save_id}


def run_retain(ctx: StepContext) -> dict[str, Any]:
    """Prune the run's old checkpoints and the outputs this pipeline's earlier steps derived
    from them (:mod:`shardckpt.watch.retain`)."""
    from shardckpt.watch.retain import retain

    earlier = tuple(s for s in ctx.steps if s.index < ctx.spec.index)
    return retain(ctx.watch, ctx.step, ctx.spec.keep or 1, earlier, ctx.storage_options,
                  ctx.is_settled, ctx.spec.keep_optimizer_last, ctx.spec.keep_every)


STEPS: dict[str, Callable[[StepContext], dict[str, Any]]] = {
    "verify": run_verify, "reshard": run_reshard, "consolidate": run_consolidate,
    "copy": run_copy, "retain": run_retain,
}


def run_step(ctx: StepContext) -> dict[str, Any]:
    """Run the step in this process (a step of several processes is a torchrun job:
    :func:`shardckpt.watch.job.run_job`)."""
    return STEPS[ctx.spec.kind](ctx)


def adopt(ctx: StepContext) -> dict[str, Any] | None:
    """The ``.done`` facts of an output that a killed watcher committed without recording it;
    None if there is no such output or it does not pass (see the module doc)."""
    kind = ctx.spec.kind
    if kind not in ("reshard", "copy", "consolidate"):
        return None
    dst = ctx.dst_storage()
    try:
        if kind == "consolidate":
            facts = committed_consolidation(ctx, dst)
            return None if facts is None else {**facts, "adopted": True}
        if not dst.exists(MANIFEST_NAME):
            return None
        m = read_manifest(dst)
        if kind == "copy" and dst.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES) != \
                ctx.src.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES):
            return None
        if kind == "reshard" and (m.mesh.world_size != ctx.spec.to
                                  or m.mesh.replicate_degree != ctx.spec.replicate
                                  or run_extras(m, dst.url).step
                                  != run_extras(ctx.manifest, ctx.src.url).step):
            return None
        if not verify(dst, manifest=m):
            return None
    except ShardckptError as e:
        log.warning("%s: an output is there but cannot be adopted (%s); running the step again",
                    dst.url, e)
        return None
    return {"output": dst.url, "bytes": sum(f.size for f in m.files), "identity": m.save_id,
            "adopted": True}


def committed_consolidation(ctx: StepContext, dst: Storage) -> dict[str, Any] | None:
    """The ``.done`` facts of the consolidation of ``ctx``'s checkpoint committed at ``dst`` (its
    index names files that all exist, its provenance names the source's save id and the dtype);
    None if there is none."""
    from shardckpt.format.dtypes import output_dtype
    from shardckpt.tools.consolidate import MODEL_INDEX, PROVENANCE

    try:
        index = json.loads(dst.read_limited(MODEL_INDEX, MAX_MANIFEST_BYTES))
        prov = json.loads(dst.read_limited(PROVENANCE, MAX_MANIFEST_BYTES))
    except NotFoundError:
        return None
    except ValueError:
        return None
    if prov.get("save_id") != ctx.manifest.save_id or prov.get("dtype") != output_dtype(ctx.spec.dtype):
        return None
    names = set(index.get("weight_map", {}).values())
    sizes = dst.list_sizes("")
    if not names or not names <= set(sizes):
        return None
    return {"output": dst.url, "bytes": sum(sizes[n] for n in names), "identity": ctx.manifest.save_id}
