"""What the importers (Hugging Face, DeepSpeed, DCP) share: the unit patterns that group
parameters into units, the writing and commit of the imported files (alone, or as the processes
of a ``torchrun`` job), and the summary of what an import wrote."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from shardckpt.errors import ConfigError

if TYPE_CHECKING:
    from shardckpt.checkpoint.writer import CheckpointSpec, Producer
    from shardckpt.format.manifest import FileEntry, Manifest
    from shardckpt.storage import Storage

log = logging.getLogger(__name__)

#: One unit per transformer block (``...layers.<i>``, under any prefix); everything else in the
#: root. The unit patterns of the DeepSpeed and DCP imports.
BLOCK_UNITS = (r"(?:.*\.)?layers\.\d+",)
#: The hyper-parameters of an Adam-family param group that an import keeps.
ADAM_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def unit_of(fqn: str, patterns: Sequence["re.Pattern[str]"]) -> str:
    """The unit of ``fqn``: the prefix the first matching pattern covers (whole name components),
    else the root (``""``)."""
    for p in patterns:
        m = p.match(fqn)
        if m:
            return m.group(0)
    return ""


def compile_units(patterns: Sequence[str]) -> list["re.Pattern[str]"]:
    """Each pattern, anchored to match whole name components; a bad one is a :class:`ConfigError`."""
    out = []
    for pat in patterns:
        try:
            out.append(re.compile(rf"(?:{pat})(?=\.|$)"))
        except re.error as e:
            raise ConfigError(f"unit pattern {pat!r} is not a regular expression: {e}") from None
    return out


def import_summary(m: "Manifest", dst: str, source_format: str) -> dict[str, Any]:
    """What an import wrote to ``dst``, as plain data (what ``shardckpt import --json`` prints).

    Flat groups: the mesh, parameters, units and bytes, and per ``source_format`` (``hf``,
    ``deepspeed``, ``dcp``) what the source recorded; DCP's chunks kept as they are: tensors,
    other values, files and bytes."""
    if m.chunked is not None:
        return {"destination": dst, "save_id": m.save_id, "tensors": len(m.chunked.tensors),
                "values": len(m.chunked.blobs), "files": len(m.files), "bytes": m.total_bytes}
    layout = m.components["model"].layout
    out: dict[str, Any] = {"destination": dst, "save_id": m.save_id, "ranks": m.mesh.world_size,
                           "replicate": m.mesh.replicate_degree, "params": len(layout.params),
                           "units": len({g.unit for g in layout.groups}), "bytes": m.total_bytes}
    if source_format == "hf":
        out["hf_config"] = "hf_config" in m.extras
    elif source_format == "deepspeed":
        ds = m.extras.get("deepspeed", {})
        out.update(step=m.extras.get("step"), zero_stage=ds.get("stage"),
                   source_world_size=ds.get("world_size"))
    else:
        out["step"] = m.extras.get("step")
    return out


# ------------------------------------------------------------------------- writing and commit


class ImportJob(Protocol):
    """The processes of a ``torchrun`` job (:class:`shardckpt.tools.distributed.Job`): every
    process calls the same methods in the same order."""

    rank: int
    world_size: int

    @property
    def is_root(self) -> bool: ...

    def agree(self, fn: Callable[[], Any], what: str) -> list[Any]: ...

    def on_root(self, fn: Callable[[], Any], what: str) -> Any: ...

    def share(self, costs: Sequence[int]) -> list[int]: ...


def write_import(out: "Storage", spec: "CheckpointSpec", what: str,
                 shard: Callable[[int], "Producer"], buffers: "Producer | None" = None,
                 job: ImportJob | None = None) -> "Manifest":
    """Write the shard files of ``spec`` (``shard(s)`` produces shard ``s``'s bytes) and its
    buffers file, then commit ``manifest.json`` at ``out``; on any error nothing is committed and
    the attempt's files are removed. Returns the committed manifest.

    Alone (``job`` None) one process writes every file, in order. In a job every process calls
    this with the same ``spec``: rank 0 checks the destination, picks the save id and holds the
    attempt's lease; each process writes its byte-balanced share of the files; rank 0 commits
    once every process has reported its files written. Any process's failure fails every
    process with the same error (the lowest failing rank's).
    """
    from shardckpt.checkpoint.writer import CheckpointWriter

    if job is None:
        writer = CheckpointWriter(out, spec)
        out.ensure_free_space("", writer.data_bytes(), what)
        try:
            with writer.lease():  # `shardckpt clean` leaves the attempt alone while it runs
                entries = _write_files(writer, range(spec.mesh.shard_degree + 1), shard, buffers,
                                       what)
                return writer.commit(entries)
        except BaseException:
            writer.discard()  # a failed import leaves no debris where it can remove it
            raise
    return _write_as_job(job, out, spec, what, shard, buffers)


def _write_files(writer: Any, items: Sequence[int], shard: Callable[[int], "Producer"],
                 buffers: "Producer | None", what: str) -> list["FileEntry"]:
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


def _write_as_job(job: ImportJob, out: "Storage", spec: "CheckpointSpec", what: str,
                  shard: Callable[[int], "Producer"], buffers: "Producer | None") -> "Manifest":
    import dataclasses
    import hashlib

    from shardckpt.checkpoint.writer import CheckpointWriter
    from shardckpt.format.manifest import MANIFEST_NAME, FileEntry, to_json

    # what every process must agree on: the manifest, files and time apart
    plain = dataclasses.replace(CheckpointWriter(out, spec, "-").manifest(()), created_at="")
    digest = hashlib.sha256(to_json(plain)).hexdigest()
    if len(set(job.agree(lambda: digest, f"{what}: reading the source"))) != 1:
        raise ConfigError(f"{what}: the processes of the job read different sources (the source "
                          "changed while they read it, or their options differ); run again")
    root: dict[str, Any] = {}

    def prepare() -> str:
        if out.exists(MANIFEST_NAME):
            raise ConfigError(f"{out.url_of(MANIFEST_NAME)} exists; import into an empty location")
        w = root["writer"] = CheckpointWriter(out, spec)
        out.ensure_free_space("", w.data_bytes(), what)
        root["lease"] = w.lease()
        root["lease"].__enter__()  # held until the job's outcome is known
        return w.save_id

    def commit() -> None:
        root["manifest"] = root["writer"].commit(entries)

    try:
        writer = CheckpointWriter(out, spec, job.on_root(prepare, f"{what}: preparing the "
                                                                   "destination"))
        shard_bytes = writer.slots[-1].end if writer.slots else 0  # every shard file alike
        costs = [shard_bytes] * spec.mesh.shard_degree + [writer.buffer_slots[-1].end
                                                          if writer.buffer_slots else 0]
        mine = job.share(costs)
        reports = job.agree(lambda: [e.to_doc() for e in _write_files(writer, mine, shard,
                                                                       buffers, what)],
                            f"{what}: writing the files")
        entries = [FileEntry.from_doc(d) for part in reports for d in part]
        job.on_root(commit, f"{what}: committing")
    except BaseException as e:
        if "manifest" not in root:
            _release(root)
            if "writer" in root:
                root["writer"].discard()
            raise
        # committed: only telling the others failed (one of them is gone)
        log.warning("%s: committed save %s, but could not tell every process (%s)", out.url,
                    root["writer"].save_id, e)
    _release(root)
    return root.get("manifest") or writer.manifest(entries)


def _release(root: dict[str, Any]) -> None:
    if "lease" in root:
        root.pop("lease").__exit__(None, None, None)
