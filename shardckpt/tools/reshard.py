"""Offline resharding: turn a checkpoint of N ranks into one of M ranks (or another HSDP mesh).

Streams through the pure :func:`~shardckpt.format.reshard_plan.plan_reshard` plan: each target shard file is
written front to back, its bytes read from the source shards with checked ranged reads in pieces of
at most ``buffer_bytes`` (:mod:`shardckpt.tools.reshard_stream`); memory is bounded by that buffer
(plus a few cached boundary chunks), not by the checkpoint. The target's manifest is created last,
so an interrupted or failed reshard leaves nothing a reader takes for whole. Per-rank state (RNG)
cannot follow a change of world size: it is dropped, and the manifest says so.

A checkpoint of chunked tensors (saved through DCP) is resharded into the chunks FSDP2 would save
at M ranks, or into flat groups (``fmt="flat"``): :mod:`shardckpt.tools.reshard_chunked`. Every
kind of target is a *target* object (:class:`FlatTarget` here) that says what each target file
holds and writes a share of them; the flow below is the same for all.

One flow for one process and for the processes of a ``torchrun`` job (a
:class:`~shardckpt.checkpoint.job.Job`; one process is a job of one): :func:`open_source` opens
the source once per process (the processes agree on the manifest they read), and
:func:`write_reshard` writes each process's byte-balanced share of the target files (in that
process, or over ``--workers`` spawned processes), rank 0 holding the attempt's lease and
committing once every file is written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from shardckpt.checkpoint.attempt import Attempt, Steps
from shardckpt.checkpoint.job import Job, balance
from shardckpt.checkpoint.reader import CheckpointReader, as_storage
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.errors import ConfigError, IncompatibleLayoutError
from shardckpt.format.layout import Mesh
from shardckpt.format.signing import SigningKey
from shardckpt.checkpoint.trust import signing_key
from shardckpt.format.manifest import MANIFEST_NAME, Component, Manifest
from shardckpt.format.records import PerRankState
from shardckpt.format.reshard_plan import ReshardPlan, plan_reshard
from shardckpt.storage import DEFAULT_BATCH, Storage
from shardckpt.format.manifest import FileEntry
from shardckpt.tools.reshard_stream import Written, write_shards
from shardckpt.tools.reshard_target import ReshardTarget, prepare_dst, remove_replaced
from shardckpt.tools.split import shard_bytes

log = logging.getLogger(__name__)

#: Smallest read batch: below it, batches re-read (and re-check) each source chunk many times.
MIN_BUFFER = 64 << 10


@dataclass(frozen=True)
class ReshardResult:
    manifest: Manifest
    source_world_size: int
    bytes_written: int
    bytes_read: int
    seconds: float


def target_spec(src: Manifest, mesh: Mesh) -> tuple[CheckpointSpec, dict[str, ReshardPlan]]:
    """The target's manifest-to-be and one plan per component. Pure."""
    components: dict[str, Component] = {}
    plans: dict[str, ReshardPlan] = {}
    for name, c in src.components.items():
        layout = c.layout.with_mesh(mesh)
        plans[name] = plan_reshard(c.layout, layout)
        components[name] = replace(c, layout=layout)
    per_rank = PerRankState(mesh.world_size, src.mesh.world_size, "per-rank state (RNG) cannot "
                            "follow a change of world size; reshard dropped it").to_doc()
    spec = CheckpointSpec(mesh, components, src.optimizer, dict(src.extras), per_rank, src.chunk_size)
    return spec, plans


@dataclass(frozen=True)
class FlatTarget:
    """Flat groups from flat groups: the target's spec and one plan per component. A target
    (this, or those of :mod:`shardckpt.tools.reshard_chunked`) names its files by index (here the
    shard ranks), says what each costs, and writes a share of them; it travels to ``--workers``
    processes pickled."""

    spec: CheckpointSpec
    plans: Mapping[str, ReshardPlan]

    def writer(self, dst: Storage, save_id: str | None = None) -> CheckpointWriter:
        return CheckpointWriter(dst, self.spec, save_id)

    def data_bytes(self, writer: CheckpointWriter) -> int:
        return writer.data_bytes()

    def costs(self) -> list[int]:
        """Bytes read plus bytes written, per target file."""
        return [r + w for r, w in shard_bytes(self.spec, self.plans)]

    def write(self, reader: CheckpointReader, writer: CheckpointWriter, files: Sequence[int],
              buffer_bytes: int, on_bytes: Callable[[int], None] | None) -> Written:
        return write_shards(reader, self.plans, writer, files, buffer_bytes, on_bytes)

    def has_buffers(self, reader: CheckpointReader) -> bool:
        return reader.manifest.buffers_file() is not None

    def write_buffers(self, reader: CheckpointReader, writer: CheckpointWriter,
                      buffer_bytes: int) -> FileEntry | None:
        return writer.write_buffers(lambda slot: iter([reader.read_buffer(slot.name)[1]]))


@dataclass(frozen=True)
class ReshardSource:
    """The opened source and what follows from it alone: the target (its spec and plan)."""

    reader: CheckpointReader
    target: ReshardTarget
    started: float  # time.perf_counter() when the work began (the result's seconds count from it)

    @property
    def spec(self) -> CheckpointSpec:
        return self.target.spec


def signed_by(source: ReshardSource, key: str | SigningKey | None) -> ReshardSource:
    """``source`` whose target is written with digests and signed with ``key`` (a private key
    file's path, or a key; None: as it is)."""
    key = signing_key(key)
    if key is None:
        return source
    return replace(source, target=replace(source.target, spec=replace(source.target.spec, signing_key=key)))


def _check_work(m: Manifest, mesh: Mesh, to: int, buffer_bytes: int) -> None:
    """Refuse work that cannot make progress: a shard degree beyond the data (every shard of
    every group mostly padding), or read batches so small that each checksum chunk of the source
    is read and checked over and over."""
    if buffer_bytes < MIN_BUFFER:
        raise ConfigError(f"--buffer {buffer_bytes} bytes: below the minimum of {MIN_BUFFER} bytes "
                          f"({MIN_BUFFER >> 10} KiB)")
    groups = [g for c in m.components.values() for g in c.layout.groups]
    if not groups:
        return
    largest = max(groups, key=lambda g: g.numel)
    limit = max(1, -(-largest.numel // 16))
    if mesh.shard_degree > limit:
        raise ConfigError(
            f"--to {to}: a shard degree of {mesh.shard_degree} leaves shard ranks without data: the "
            f"largest flat group ({largest.name}, {largest.numel} elements) fills at most {limit} "
            f"shards of 16 elements; choose --to <= {limit * mesh.replicate_degree}")


def open_source(src: str | Storage, to: int, from_: int | None = None, replicate: int = 1,
                storage_options: Mapping[str, Any] | None = None,
                buffer_bytes: int = DEFAULT_BATCH, job: Job | None = None,
                fmt: str | None = None) -> ReshardSource:
    """Check the options and open the source (its manifest read once per process) and plan the
    target. In a job every process opens it, and they must have read the same manifest.

    ``fmt``: ``"chunked"`` (the chunks FSDP2 would save), ``"flat"`` (flat groups), or None for
    the source's own kind."""
    job = job or Job.single()
    t0 = time.perf_counter()

    def open_() -> ReshardSource:
        if to is None or to < 1:
            raise ConfigError(f"--to {to}: the target world size must be >= 1")
        if replicate < 1 or to % replicate:
            raise ConfigError(f"--to {to} is not divisible by --replicate {replicate}")
        reader = CheckpointReader(src, storage_options)
        m = reader.manifest
        if from_ is not None and from_ != m.mesh.world_size:
            raise IncompatibleLayoutError(
                f"{reader.storage.url_of(MANIFEST_NAME)}: --from {from_} does not match the "
                f"checkpoint's world size {m.mesh.world_size} (mesh {m.mesh.describe()})")
        mesh = Mesh.for_world(to, replicate)
        _check_work(m, mesh, to, buffer_bytes)
        if m.chunked is not None or fmt not in (None, "flat"):
            from shardckpt.tools.reshard_chunked import chunked_target

            return ReshardSource(reader, chunked_target(reader, mesh, fmt), t0)
        return ReshardSource(reader, FlatTarget(*target_spec(m, mesh)), t0)

    return job.open(open_, lambda s: s.reader.manifest.save_id,
                    src if isinstance(src, str) else src.url, "reshard: opening the source")


def write_reshard(source: ReshardSource, dst: Storage, overwrite: bool = False, workers: int = 1,
                  buffer_bytes: int = DEFAULT_BATCH, progress: Callable[[int], None] | None = None,
                  job: Job | None = None) -> ReshardResult:
    """Write the target of ``source`` at ``dst`` and commit it; every process of ``job`` calls
    it and gets the same result (or raises the same error).

    Rank 0 guards the destination, picks the save id and holds the attempt's lease until the
    outcome is known; each process writes its byte-balanced share of the files (over
    ``workers`` processes of its own where more than one); rank 0 commits once every file is
    written. On failure nothing is committed and the attempt's directory is removed. With
    ``overwrite``, an existing checkpoint at ``dst`` is replaced only once the new one is
    complete, then what it replaced is removed.
    """
    job = job or Job.single()
    attempt = Attempt(job, dst.url, Steps("reshard: preparing the destination",
                                          "reshard: writing the target files", "reshard: committing"),
                      lambda save_id: source.target.writer(dst, save_id),
                      guard=lambda: prepare_dst(dst, source.reader.storage, overwrite),
                      room=lambda w: dst.ensure_free_space("", source.target.data_bytes(w), "reshard"))
    attempt.run(lambda w: _write_share(job, source, w, workers, buffer_bytes, progress).to_doc(),
                lambda w, reports: w.commit(Written.join([Written.from_doc(d) for d in reports]).entries,
                                            attempt.guarded))
    done = Written.join([Written.from_doc(d) for d in attempt.reports])
    manifest = attempt.committed
    if overwrite and manifest is not None:
        remove_replaced(dst, attempt.guarded, manifest.save_id)
    assert attempt.writer is not None
    return ReshardResult(manifest or attempt.writer.manifest(done.entries),
                         source.reader.manifest.mesh.world_size,
                         sum(e.size for e in done.entries), done.bytes_read,
                         time.perf_counter() - source.started)


def _write_share(job: Job, source: ReshardSource, writer: CheckpointWriter, workers: int,
                 buffer_bytes: int, progress: Callable[[int], None] | None) -> Written:
    """Write this process's share of the target files. The buffers file (small) goes to the
    last process, after its shards."""
    target, reader = source.target, source.reader
    costs = target.costs()
    parts = balance(costs, job.world_size)
    mine = parts[job.rank]
    k = min(workers, len(mine))
    if k <= 1:
        done = target.write(reader, writer, mine, buffer_bytes, progress)
    else:
        from shardckpt.tools.reshard_workers import run_workers

        split = balance([costs[t] for t in mine], k)
        done = run_workers(reader, target, writer, [[mine[i] for i in p] for p in split], buffer_bytes)
    if target.has_buffers(reader) and job.rank == len(parts) - 1:
        b = target.write_buffers(reader, writer, buffer_bytes)
        if b is not None:
            done = Written(done.entries + (b,), done.bytes_read)
    return done


def reshard(src: str | Storage, dst: str | Storage, to: int, from_: int | None = None,
            replicate: int = 1, workers: int = 1, overwrite: bool = False,
            storage_options: Mapping[str, Any] | None = None,
            dst_storage_options: Mapping[str, Any] | None = None,
            buffer_bytes: int = DEFAULT_BATCH,
            progress: Callable[[int], None] | None = None, job: Job | None = None,
            fmt: str | None = None, signing_key: str | SigningKey | None = None) -> ReshardResult:
    """Reshard ``src`` to a world of ``to`` ranks (mesh ``replicate`` x ``to/replicate``) at ``dst``.

    ``from_`` is a guard: it must equal the source's world size. With ``overwrite``, an existing
    checkpoint at ``dst`` is replaced only once the new one is complete. ``workers`` processes
    split the target shards; under ``torchrun`` (``job``) the job's processes split them.
    ``fmt``: ``"chunked"`` or ``"flat"`` (None: the source's kind; a checkpoint of chunked
    tensors can become either). ``signing_key``: sign the target (docs/FORMAT.md section 16).
    :func:`open_source`, then :func:`write_reshard`.
    """
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be >= 1")
    source = open_source(src, to, from_, replicate, storage_options, buffer_bytes, job, fmt)
    source = signed_by(source, signing_key)
    dst_opts = dst_storage_options if dst_storage_options is not None else storage_options
    return write_reshard(source, as_storage(dst, dst_opts), overwrite, workers, buffer_bytes,
                         progress, job)
