"""The offline tools as the processes of a ``torchrun`` job.

``torchrun --nnodes ... --nproc_per_node ... -m shardckpt reshard SRC DST --to M`` runs the same
command in every process. Each takes a share of the output files, balanced by bytes, reads only
the ranges those files need and writes them; the processes agree on the outcome through the
process group (raw bytes over :mod:`shardckpt.checkpoint.collective`, no pickling); rank 0 holds the
attempt's lease and commits the manifest once every process has reported its files written. Any
failure fails every process with the same error and commits nothing; a process that dies makes
the others' next collective fail (at once where the connection drops, else within the process
group's timeout, ``SHARDCKPT_DIST_TIMEOUT_S`` seconds, 1800 by default).

The imports (``import hf|deepspeed|dcp ... --ranks N``) split their shard files the same way,
through :func:`shardckpt.interop.importing.write_import`, which takes a :class:`Job`.

torch is loaded (here and by :mod:`shardckpt.checkpoint.collective`) only when the launcher's variables say
this process is one of a job: a plain ``shardckpt reshard`` never loads it.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from shardckpt.errors import CollectiveError, ConfigError, ShardckptError
from shardckpt.tools.split import balance, contiguous_split, shard_bytes

log = logging.getLogger(__name__)

#: Set by torchrun (and by any launcher that uses its ``env://`` rendezvous) in every process.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_VARIABLE = "SHARDCKPT_DIST_TIMEOUT_S"
#: ``SHARDCKPT_DIST=0`` runs a command alone even with torchrun's variables set: a command started
#: from inside a training job's worker inherits them and must not join that job's rendezvous.
OPT_OUT_VARIABLE = "SHARDCKPT_DIST"
DEFAULT_TIMEOUT_S = 1800.0


def launched() -> bool:
    """Whether this process was started by torchrun (its variables are all set) to run as a job
    (not opted out with ``SHARDCKPT_DIST=0``)."""
    if os.environ.get(OPT_OUT_VARIABLE, "").strip() == "0":
        return False
    return all(os.environ.get(k) for k in LAUNCH_VARIABLES)


@dataclass(frozen=True)
class Job:
    """This process's place in the job. Every process calls the same methods in the same order."""

    rank: int
    world_size: int
    group: Any = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def agree(self, fn: Callable[[], Any], what: str) -> list[Any]:
        """Run ``fn`` here (its result JSON), then every process's result, in rank order; if ``fn``
        failed anywhere, every process raises the lowest failing rank's error (same class)."""
        from shardckpt.checkpoint.collective import agree, same_error

        try:
            _, reports = agree(fn, what, self.group)
        except CollectiveError as e:
            raise same_error(e, what) from e
        return [r["payload"] for r in reports]

    def on_root(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on rank 0 only; its JSON result (or its error) on every process."""
        return self.agree(lambda: fn() if self.is_root else None, what)[0]

    def share(self, costs: Sequence[int]) -> list[int]:
        """The items (indices into ``costs``) this process takes: :func:`balance`'s split."""
        return balance(costs, self.world_size)[self.rank]


def _timeout_s() -> float:
    text = os.environ.get(TIMEOUT_VARIABLE, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"{TIMEOUT_VARIABLE}={text!r}: expected a positive number of seconds")
    return value


@contextmanager
def job_from_environment() -> Iterator[Job | None]:
    """The job this process belongs to (its process group initialized, gloo, from the launcher's
    variables), or None where it was not launched by torchrun."""
    if not launched():
        yield None
        return
    timeout = _timeout_s()
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    try:
        yield Job(dist.get_rank(), dist.get_world_size())
    finally:
        if own:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------ reshard


def reshard_job(job: Job, src: str, dst: str, to: int, from_: int | None, replicate: int,
                overwrite: bool, storage_options: Mapping[str, Any] | None,
                dst_storage_options: Mapping[str, Any] | None, buffer_bytes: int,
                progress: Callable[[int], None] | None = None) -> Any:
    """:func:`shardckpt.tools.reshard.reshard` over the processes of ``job``; every process calls it
    and gets the same :class:`~shardckpt.tools.reshard.ReshardResult` (or raises the same error)."""
    from shardckpt.tools import reshard as rs

    t0 = time.perf_counter()
    here: dict[str, Any] = {}

    def open_source() -> str:
        here["reader"], here["mesh"] = rs.open_source(src, to, from_, replicate, storage_options,
                                                      buffer_bytes)
        return here["reader"].manifest.save_id

    opened = job.agree(open_source, "reshard: opening the source")
    if len(set(opened)) != 1:  # the source was replaced while the processes opened it
        raise ShardckptError(f"{src}: the source checkpoint changed while the job opened it "
                             f"(saves {', '.join(sorted(set(opened)))}); run again")
    reader, mesh = here["reader"], here["mesh"]
    dst_opts = dst_storage_options if dst_storage_options is not None else storage_options
    spec, plans = rs.target_spec(reader.manifest, mesh)
    root: dict[str, Any] = {}

    def prepare() -> str:
        root["storage"], root["replacing"], root["writer"] = rs.open_destination(
            reader, mesh, dst, dst_opts, overwrite)
        root["lease"] = root["writer"].lease()
        root["lease"].__enter__()  # held until the job's outcome is known
        return root["writer"].save_id

    def commit() -> None:
        root["manifest"] = root["writer"].commit(entries, root["replacing"])

    try:
        save_id = job.on_root(prepare, "reshard: preparing the destination")
        entries, nread = _write_share(job, rs, reader, mesh, spec, plans, src, storage_options, dst,
                                      dst_opts, save_id, buffer_bytes, progress)
        job.on_root(commit, "reshard: committing")
    except BaseException as e:
        if "manifest" not in root:
            _release(root)
            if "writer" in root:
                rs.discard_attempt(root["writer"], dst, e)
            raise
        # committed: only telling the others failed (one of them is gone)
        log.warning("%s: committed save %s, but could not tell every process (%s)", dst, save_id, e)
    _release(root)
    if overwrite and job.is_root:
        rs._remove_replaced(root["storage"], root["replacing"], save_id)
    manifest = root.get("manifest") or rs.CheckpointWriter(
        rs.as_storage(dst, dst_opts), spec, save_id).manifest(entries)
    return rs.ReshardResult(manifest, reader.manifest.mesh.world_size,
                            sum(e.size for e in entries), nread, time.perf_counter() - t0)


def _release(root: dict[str, Any]) -> None:
    if "lease" in root:
        root.pop("lease").__exit__(None, None, None)


def _write_share(job: Job, rs: Any, reader: Any, mesh: Any, spec: Any, plans: Any, src: str,
                 src_options: Mapping[str, Any] | None, dst: str,
                 dst_options: Mapping[str, Any] | None, save_id: str, buffer_bytes: int,
                 progress: Callable[[int], None] | None) -> tuple[list[Any], int]:
    """Write this process's share of the target files; every process's entries, and the bytes
    the whole job read. The buffers file (small) goes to the least loaded process."""
    parts = balance([r + w for r, w in shard_bytes(spec, plans)], job.world_size)
    buffers = reader.manifest.buffers_file()
    mine = parts[job.rank]
    takes_buffers = buffers is not None and job.rank == len(parts) - 1

    def write() -> dict[str, Any]:
        entries, nread = ([], 0)
        if mine:
            entries, nread = rs._write_shards(src, src_options, dst, dst_options, mesh, save_id,
                                              mine, buffer_bytes, progress)
        if takes_buffers:
            writer = rs.CheckpointWriter(rs.as_storage(dst, dst_options), spec, save_id)
            b = writer.write_buffers(lambda slot: iter([reader.read_buffer(slot.name)[1]]))
            if b is not None:
                entries.append(b)
        return {"read": nread, "entries": [e.to_doc() for e in entries]}

    reports = job.agree(write, "reshard: writing the target files")
    entries = [rs.FileEntry.from_doc(e) for r in reports for e in r["entries"]]
    return entries, sum(r["read"] for r in reports)


# -------------------------------------------------------------------------------- consolidate


def consolidate_job(job: Job, reader: Any, plan: Any, dst: str, overwrite: bool,
                    storage_options: Mapping[str, Any] | None, buffer_bytes: int,
                    progress: Callable[[int], None] | None, copy_from: str | None) -> Any:
    """:func:`shardckpt.tools.consolidate.write_consolidation` over the processes of ``job``: each
    writes its share of the weight files (balanced by bytes read and written); rank 0 writes the
    index, which commits DST, once every file is written. Every process calls it."""
    import dataclasses

    from shardckpt.checkpoint.reader import as_storage
    from shardckpt.tools import consolidate as cs
    from shardckpt.format.dtypes import itemsize

    t0 = time.perf_counter()
    root: dict[str, Any] = {}

    def prepare() -> dict[str, Any]:
        t = root["target"] = cs.prepare_target(reader, plan, dst, overwrite, storage_options,
                                               copy_from)
        return {"token": t.token, "model": [f.name for f in t.model_files],
                "opt": [f.name for f in t.opt_files]}

    names = job.on_root(prepare, "consolidate: preparing the destination")
    target = root.get("target") or cs.Target(
        as_storage(dst, storage_options), [], names["token"],
        tuple(dataclasses.replace(f, name=n) for f, n in zip(plan.files, names["model"])),
        tuple(dataclasses.replace(f, name=n) for f, n in zip(plan.optimizer_files, names["opt"])),
        None, [])
    files = target.model_files + target.opt_files
    costs = [f.size + sum(t.numel * itemsize(t.source.dtype) for t in f.tensors) for f in files]
    mine = [files[i] for i in balance(costs, job.world_size)[job.rank]]
    engine = cs.piece_reader(reader, buffer_bytes)

    def write() -> dict[str, int]:
        written = cs._install(target.storage, mine, engine, target.token, progress) if mine else 0
        return {"written": written, "read": engine.bytes_read}

    try:
        reports = job.agree(write, "consolidate: writing the weight files")
    except BaseException:
        cs._remove_quietly(target.storage, [f.name for f in mine])  # written here, not committed
        raise
    job.on_root(lambda: cs.commit_target(reader, plan, target), "consolidate: committing")
    return cs.result_of(reader, plan, target, sum(r["read"] for r in reports),
                        sum(r["written"] for r in reports), t0)


# ------------------------------------------------------------------------------------- verify


def verify_job(job: Job, storage: Any, workers: int, progress: Callable[[int], None] | None,
               manifest: Any) -> Any:
    """:func:`shardckpt.checkpoint.verify.verify` over the processes of ``job``: each checks its share of
    the files (balanced by bytes); every process gets every file's report, in manifest order."""
    from shardckpt.checkpoint.reader import read_manifest
    from shardckpt.checkpoint.verify import FileReport, VerifyResult, verify

    if manifest is None:
        try:
            manifest = read_manifest(storage)
        except ShardckptError as e:
            manifest = e
    failed = isinstance(manifest, ShardckptError)
    seen = job.agree(lambda: "" if failed else manifest.save_id, "verify: reading the manifest")
    if len(set(seen)) != 1:
        raise ShardckptError(f"{storage.url}: the processes read different manifests (saves "
                             f"{', '.join(sorted(repr(s) for s in set(seen)))}); run again")
    if failed:
        return VerifyResult(storage.url, None, (), (str(manifest),))
    m = manifest
    mine = {m.files[i].path for i in balance([f.size for f in m.files], job.world_size)[job.rank]}

    def check() -> list[list[Any]]:
        r = verify(storage, workers=workers, progress=progress, manifest=m, paths=mine)
        return [[x.path, x.size, x.ok, list(x.problems)] for x in r.reports]

    found = {p: FileReport(p, size, ok, tuple(problems))
             for part in job.agree(check, "verify: checking the files")
             for p, size, ok, problems in part}
    reports = tuple(found[f.path] for f in m.files)
    return VerifyResult(storage.url, m, reports, tuple(p for r in reports for p in r.problems))


# --------------------------------------------------------------------------------------- diff


def diff_job(job: Job, ra: Any, rb: Any, plan: Any, buffer_bytes: int,
             progress: Callable[[int], None] | None) -> Any:
    """:func:`shardckpt.tools.diff.run_diff` over the processes of ``job``: each compares a run of the
    planned pairs (balanced by bytes); rank 0 compares the chunked tensors too. Every process
    gets the result the single-process command gives."""
    from shardckpt.tools import diff as df

    t0 = time.perf_counter()
    costs = [c.numel * (df.itemsize(c.a.dtype) + df.itemsize(c.b.dtype)) for c in plan.comparisons]
    mine = contiguous_split(costs, job.world_size)[job.rank]
    sub = df.DiffPlan(tuple(plan.comparisons[i] for i in mine), (), ())

    def compare() -> dict[str, Any]:
        r = df.run_diff(ra, rb, sub, buffer_bytes, progress, chunked=False)
        out = {"compared": r.compared, "identical": r.identical, "elements": r.elements,
               "read": r.bytes_read, "diffs": [d.to_dict() for d in r.differences]}
        if job.is_root and (ra.manifest.chunked is not None or rb.manifest.chunked is not None):
            more, n, same, elements, nbytes = df._chunked_diff(ra, rb, buffer_bytes, progress)
            out["chunked"] = {"compared": n, "identical": same, "elements": elements,
                              "read": nbytes, "diffs": [d.to_dict() for d in more]}
        return out

    reports = job.agree(compare, "diff: comparing")
    parts = reports + [r["chunked"] for r in reports if "chunked" in r]
    diffs = tuple(df.TensorDiff(**{**d, "max_abs_diff": float(d["max_abs_diff"])})
                  for part in parts for d in part["diffs"]) + plan.one_sided
    return df.DiffResult(ra.url, rb.url, not diffs and not plan.metadata,
                         sum(p["compared"] for p in parts), sum(p["identical"] for p in parts),
                         diffs, plan.metadata, sum(p["read"] for p in parts),
                         time.perf_counter() - t0, sum(p["elements"] for p in parts))
