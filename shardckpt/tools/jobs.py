"""The offline commands as one call each: open the inputs, plan, run alone or as a ``torchrun`` job.

Each ``run_*`` function opens what its command reads once (the source's reader and plan, the
destination's storage; a source may come as a :class:`~shardckpt.storage.Storage` already
open, as the command line's run-directory check leaves it) and passes them down to the tool's one
flow, a job of one process alone or the processes of a ``torchrun`` job (``job`` from
:func:`shardckpt.tools.distributed.job_from_environment`: every process calls the same function,
opens its inputs and does its share). It learns from the plan how many bytes the work moves and
opens the caller's progress display with that total (``progress(total)``, a context manager that
yields the per-byte callback) where one process does all the work; no progress is shown in a
job. Errors are raised as the tools raise them.

Heavy modules (numpy for consolidate and diff, torch for a job) are imported by the functions
that need them, so that a command loads only what it uses.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

if TYPE_CHECKING:
    from shardckpt.checkpoint.verify import VerifyResult
    from shardckpt.interop.importer import ImportOptions, Importer
    from shardckpt.format.manifest import Manifest
    from shardckpt.tools.consolidate import ConsolidateResult
    from shardckpt.tools.diff import DiffResult
    from shardckpt.checkpoint.job import Job
    from shardckpt.tools.reshard import ReshardResult
    from shardckpt.storage import Storage

Tick = Callable[[int], None]
#: Opens a progress display for work of ``total`` bytes and yields the callback counting bytes.
OpenProgress = Callable[[int], AbstractContextManager[Tick]]


def _ignore(nbytes: int) -> None:
    """The progress callback of a process that shows none (a ``torchrun`` job's)."""


def describe(url: str | Storage, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """:func:`shardckpt.tools.summary.summarize` of the checkpoint at ``url``: its manifest only."""
    from shardckpt.checkpoint.reader import as_storage, read_manifest
    from shardckpt.tools.summary import summarize

    storage = as_storage(url, storage_options)
    return summarize(read_manifest(storage), url if isinstance(url, str) else storage.url)


def run_reshard(src: str | Storage, dst: str, to: int, from_: int | None, replicate: int,
                workers: int, overwrite: bool, storage_options: Mapping[str, Any] | None,
                buffer_bytes: int, job: Job | None, progress: OpenProgress,
                fmt: str | None = None, signing_key: str | None = None) -> ReshardResult:
    """:func:`shardckpt.tools.reshard.reshard` of ``src`` into ``dst`` (signed with the key file
    ``signing_key``, if given): the source opened and
    planned once, the destination opened once; its total is the bytes of the source, shown
    where one process reshards alone (``workers`` 1, no job). Under ``torchrun`` the job's
    processes split the target files, and ``workers`` is not used. ``fmt``: the target's kind
    (``"chunked"``, ``"flat"``; None: the source's)."""
    from shardckpt.checkpoint.job import Job
    from shardckpt.checkpoint.reader import as_storage
    from shardckpt.errors import ConfigError
    from shardckpt.tools.reshard import open_source, signed_by, write_reshard

    if job is None and workers < 1:
        raise ConfigError(f"--workers {workers}: must be >= 1")
    alone = job is None
    job = job or Job.single()
    source = signed_by(open_source(src, to, from_, replicate, storage_options, buffer_bytes, job, fmt),
                       signing_key)
    out = as_storage(dst, storage_options)
    if not alone or workers != 1:  # worker processes and a job's processes report no progress
        return write_reshard(source, out, overwrite, workers if alone else 1, buffer_bytes,
                             _ignore, job)
    with progress(source.reader.manifest.total_bytes) as tick:
        return write_reshard(source, out, overwrite, 1, buffer_bytes, tick, job)


def run_verify(url: str | Storage, storage_options: Mapping[str, Any] | None, workers: int,
               job: Job | None, progress: OpenProgress, digests: bool = False,
               trust: Any = None) -> VerifyResult:
    """:func:`shardckpt.checkpoint.verify.verify` of the checkpoint at ``url``, its manifest read
    once (twice with ``trust``: the check reads its own bytes); a manifest that cannot be read
    is the result's problem, not an exception."""
    from shardckpt.checkpoint.reader import as_storage
    from shardckpt.checkpoint.verify import manifest_or_error, verify
    from shardckpt.errors import ShardckptError

    storage = as_storage(url, storage_options)
    m = manifest_or_error(storage)
    checks = {"digests": digests, "trust": trust}
    if job is not None:
        return verify(storage, workers=workers, progress=_ignore, manifest=m, job=job, **checks)
    with progress(0 if isinstance(m, ShardckptError) else m.total_bytes) as tick:
        return verify(storage, workers=workers, progress=tick, manifest=m, **checks)


def run_consolidate(src: str | Storage, dst: str, dtype: str, max_shard_size: int,
                    component: str, prefix: str | None, optimizer: bool, overwrite: bool,
                    copy_from: str | None, storage_options: Mapping[str, Any] | None,
                    buffer_bytes: int, job: Job | None,
                    progress: OpenProgress, keep_buffers: bool = False) -> ConsolidateResult:
    """:func:`shardckpt.tools.consolidate.write_consolidation` of ``src`` into ``dst``, the source
    opened and planned once; its total is the bytes the plan reads."""
    from shardckpt.checkpoint.job import Job, open_readers
    from shardckpt.tools.consolidate import write_consolidation
    from shardckpt.tools.consolidate_plan import plan_consolidation

    alone = job is None
    job = job or Job.single()
    reader, = open_readers(job, [src], storage_options, "consolidate: opening the source")
    plan = plan_consolidation(reader.manifest, dtype, max_shard_size, component, optimizer,
                              src if isinstance(src, str) else reader.url, prefix, keep_buffers)
    if not alone:
        return write_consolidation(reader, plan, dst, overwrite, storage_options, buffer_bytes,
                                   _ignore, copy_from, job)
    with progress(plan.source_bytes) as tick:
        return write_consolidation(reader, plan, dst, overwrite, storage_options, buffer_bytes,
                                   tick, copy_from, job)


def run_diff(a: str | Storage, b: str | Storage, storage_options: Mapping[str, Any] | None,
             buffer_bytes: int, job: Job | None, progress: OpenProgress,
             tolerance: Any = None) -> DiffResult:
    """:func:`shardckpt.tools.diff.run_diff` of ``a`` and ``b``, each opened once; its total is
    the bytes the plan compares."""
    from shardckpt.checkpoint.job import Job, open_readers
    from shardckpt.tools import diff as df

    alone = job is None
    job = job or Job.single()
    ra, rb = open_readers(job, [a, b], storage_options, "diff: opening the checkpoints")
    plan = df.plan_diff(ra.manifest, rb.manifest)
    if not alone:
        return df.run_diff(ra, rb, plan, buffer_bytes, _ignore, job, tolerance)
    with progress(plan.total_bytes) as tick:
        return df.run_diff(ra, rb, plan, buffer_bytes, tick, job, tolerance)


def run_import(importer: Importer, options: ImportOptions, job: Job | None = None) -> Manifest | None:
    """The import ``options`` by ``importer`` (:func:`shardckpt.interop.importer.run_importer`)
    as the processes of ``job`` (None: one process alone, a job of one): where the importer
    :meth:`~shardckpt.interop.importer.Importer.splits` the work every process writes its share of
    the files; otherwise rank 0 imports alone while the others wait for its outcome. The manifest
    it committed, on the process that reports it (None on the job's others)."""
    from shardckpt.checkpoint.job import Job
    from shardckpt.interop.importer import run_importer, with_config

    job = job or Job.single()
    options = with_config(importer, options)
    m: Manifest | None
    if importer.splits(options):
        m = run_importer(importer, options, job)
    else:
        here: dict[str, Any] = {}
        job.on_root(lambda: here.update(m=run_importer(importer, options)), "import")
        m = here.get("m")
    return m if job.is_root else None
