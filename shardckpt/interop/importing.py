"""What the importers (Hugging Face, DeepSpeed, DCP) share: the unit patterns that group
parameters into units, the writing and commit of the imported files (one flow over a
:class:`~shardckpt.checkpoint.job.Job`: one process alone, or the processes of a ``torchrun``
job), and the summary of what an import wrote."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

from shardckpt.errors import ConfigError

if TYPE_CHECKING:
    from shardckpt.checkpoint.job import Job
    from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter, Producer
    from shardckpt.format.manifest import FileEntry, Manifest
    from shardckpt.format.records import RunExtras
    from shardckpt.storage import Storage

log = logging.getLogger(__name__)

#: One unit per transformer block (``...layers.<i>``, under any prefix); everything else in the
#: root. The unit patterns of the DeepSpeed and DCP imports.
BLOCK_UNITS = (r"(?:.*\.)?layers\.\d+",)
#: The hyper-parameters of an Adam-family param group that an import keeps.
ADAM_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def unit_of(fqn: str, patterns: Sequence[re.Pattern[str]]) -> str:
    """The unit of ``fqn``: the prefix the first matching pattern covers (whole name components),
    else the root (``""``)."""
    for p in patterns:
        m = p.match(fqn)
        if m:
            return m.group(0)
    return ""


def compile_units(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    """Each pattern, anchored to match whole name components; a bad one is a :class:`ConfigError`."""
    out = []
    for pat in patterns:
        try:
            out.append(re.compile(rf"(?:{pat})(?=\.|$)"))
        except re.error as e:
            raise ConfigError(f"unit pattern {pat!r} is not a regular expression: {e}") from None
    return out


def import_summary(m: Manifest, dst: str,
                   summary: Callable[[RunExtras, str], dict[str, Any]]) -> dict[str, Any]:
    """What an import wrote to ``dst``, as plain data (what ``shardckpt import --json`` prints).

    Flat groups: the mesh, parameters, units and bytes, then what the importer says the source
    recorded (``summary``: its :meth:`~shardckpt.interop.importer.Importer.summary`); DCP's
    chunks kept as they are: tensors, other values, files and bytes."""
    if m.chunked is not None:
        return {"destination": dst, "save_id": m.save_id, "tensors": len(m.chunked.tensors),
                "values": len(m.chunked.blobs), "files": len(m.files), "bytes": m.total_bytes}
    layout = m.components["model"].layout
    out: dict[str, Any] = {"destination": dst, "save_id": m.save_id, "ranks": m.mesh.world_size,
                           "replicate": m.mesh.replicate_degree, "params": len(layout.params),
                           "units": len({g.unit for g in layout.groups}), "bytes": m.total_bytes}
    from shardckpt.format.records import run_extras

    out.update(summary(run_extras(m, dst), dst))
    return out


# ------------------------------------------------------------------------- writing and commit


def write_import(out: Storage, spec: CheckpointSpec, what: str,
                 shard: Callable[[int], Producer], buffers: Producer | None = None,
                 job: Job | None = None) -> Manifest:
    """Write the shard files of ``spec`` (``shard(s)`` produces shard ``s``'s bytes) and its
    buffers file, then commit ``manifest.json`` at ``out``; on any error nothing is committed and
    the attempt's files are removed. Returns the committed manifest.

    One flow for one process (``job`` None: :meth:`Job.single`, which writes every file, in
    order) and for the processes of a ``torchrun`` job, which all call this with the same
    ``spec``: an :class:`~shardckpt.checkpoint.attempt.Attempt` whose guard refuses a
    destination that holds a checkpoint, and whose share is each process's byte-balanced part
    of the files. Any process's failure fails every process with the same error (the lowest
    failing rank's).
    """
    from shardckpt.checkpoint.attempt import Attempt, Steps
    from shardckpt.checkpoint.job import Job
    from shardckpt.checkpoint.writer import CheckpointWriter
    from shardckpt.format.manifest import MANIFEST_NAME, FileEntry

    job = job or Job.single()
    if len(set(job.agree(lambda: _spec_digest(out, spec), f"{what}: reading the source"))) != 1:
        raise ConfigError(f"{what}: the processes of the job read different sources (the source "
                          "changed while they read it, or their options differ); run again")

    def guard() -> None:
        if out.exists(MANIFEST_NAME):
            raise ConfigError(f"{out.url_of(MANIFEST_NAME)} exists; import into an empty location")

    def share(writer: CheckpointWriter) -> list[dict[str, Any]]:
        shard_bytes = writer.slots[-1].end if writer.slots else 0  # every shard file alike
        costs = [shard_bytes] * spec.mesh.shard_degree + [writer.buffer_slots[-1].end
                                                          if writer.buffer_slots else 0]
        return [e.to_doc() for e in _write_files(writer, job.share(costs), shard, buffers, what)]

    def entries(reports: list[Any]) -> list[FileEntry]:
        return [FileEntry.from_doc(d) for part in reports for d in part]

    attempt = Attempt(job, out.url, Steps(f"{what}: preparing the destination",
                                          f"{what}: writing the files", f"{what}: committing"),
                      lambda save_id: CheckpointWriter(out, spec, save_id), guard=guard,
                      room=lambda w: out.ensure_free_space("", w.data_bytes(), what))
    m = attempt.run(share, lambda w, reports: w.commit(entries(reports)))
    assert attempt.writer is not None
    return m or attempt.writer.manifest(entries(attempt.reports))


def _spec_digest(out: Storage, spec: CheckpointSpec) -> str:
    """What every process of a job must agree on: the manifest-to-be, files and time apart."""
    import dataclasses
    import hashlib

    from shardckpt.checkpoint.writer import CheckpointWriter
    from shardckpt.format.manifest import to_json

    plain = dataclasses.replace(CheckpointWriter(out, spec, "-").manifest(()), created_at="")
    return hashlib.sha256(to_json(plain)).hexdigest()


def _write_files(writer: CheckpointWriter, items: Sequence[int],
                 shard: Callable[[int], Producer], buffers: Producer | None,
                 what: str) -> list[FileEntry]:
    """Write files ``items``: shard ``s`` for ``s`` below the shard degree, the buffers file
    (where there is one) for the shard degree."""
    S = writer.spec.mesh.shard_degree
    entries = []
    for s in items:
        if s < S:
            entries.append(writer.write_shard(s, shard(s)))
            log.info("%s: wrote shard %d of %d", what, s + 1, S)
        elif buffers is not None:
            b = writer.write_buffers(buffers)
            if b is not None:
                entries.append(b)
    return entries
