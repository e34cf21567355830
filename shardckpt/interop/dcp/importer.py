"""The ``dcp`` importer: a directory DCP's ``FileSystemWriter`` wrote, as a checkpoint that keeps
its chunks (:mod:`shardckpt.interop.dcp.import_`) or, with ``ranks``, as ``ZeroEngine`` flat
groups (:mod:`shardckpt.interop.dcp.to_flat`). Light: nothing of the format's reading code is
imported until a source is read."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from shardckpt.errors import ConfigError
from shardckpt.interop.dcp.config import DcpConfig, DcpOrigin
from shardckpt.interop.importer import (
    ImportOptions, ImportPlan, ImporterConfig, SourceInfo, file_bytes, write_flat,
)
from shardckpt.interop.importing import BLOCK_UNITS

if TYPE_CHECKING:
    from shardckpt.format.manifest import Manifest
    from shardckpt.format.records import RunExtras
    from shardckpt.checkpoint.job import Job

log = logging.getLogger("shardckpt.interop.dcp.to_flat")


class DcpImporter:
    name = "dcp"
    Config = DcpConfig
    help = """Write a DCP checkpoint as a shardckpt checkpoint (its chunks, or flat groups for --ranks).

    With --ranks, a model tensor with optimizer state (Adam's exp_avg and exp_avg_sq, or SGD's
    momentum_buffer) is a trained parameter;
    one without, equal to a trained parameter, is tied to it; one a param group lists, or
    matching --frozen, is a frozen parameter (its own dtype); any other is a persistent buffer.
    """
    source_help = ("Folder DCP's FileSystemWriter wrote (holds .metadata and __*_*.distcp; path "
                   "or fsspec URL).")
    ranks_help = "Write ZeroEngine flat groups for this world size (default: keep DCP's chunks)."
    default_units = BLOCK_UNITS
    origin = DcpOrigin

    def splits(self, options: ImportOptions) -> bool:
        # flat groups: each process writes its share of the files; chunks: one process imports
        return options.ranks is not None

    def describe_source(self, src: Any, storage_options: Mapping[str, Any] | None = None,
                        config: ImporterConfig | None = None) -> SourceInfo:
        from shardckpt.checkpoint.reader import as_storage
        from shardckpt.interop.dcp.source import METADATA_NAME, read_dcp

        storage = as_storage(src, storage_options)
        source = read_dcp(storage)
        files = (METADATA_NAME, *source.items)
        values = sum(1 for its in source.items.values() for it in its if it.offsets is None)
        return SourceInfo(self.name, storage.url, files, file_bytes(storage, files),
                          len(source.tensors), {"values": values, "version": source.version})

    def plan(self, options: ImportOptions) -> ImportPlan:
        if options.ranks is None:
            from shardckpt.interop.dcp.import_ import plan_chunks

            return plan_chunks(options)
        from shardckpt.interop.dcp.to_flat import plan_flat

        return plan_flat(options)

    def write(self, plan: ImportPlan, job: Job | None = None) -> Manifest:
        if plan.shard is None:  # DCP's chunks, kept: one process writes them
            from shardckpt.interop.dcp.import_ import write_chunks

            if job is not None and job.world_size > 1:
                raise ConfigError("import dcp keeps DCP's chunks from one process; run it "
                                  "without a job (splits() is False)")
            return write_chunks(plan)
        m = write_flat(plan, job)  # under torchrun (``job``) each process writes its share
        model = plan.state
        log.info("imported %s -> %s (%d parameters, %d frozen, %d ranks)", plan.options.src,
                 plan.out.url, len(model.params), len(model.frozen), plan.spec.mesh.world_size)
        return m

    def summary(self, extras: RunExtras, dst: str) -> dict[str, Any]:
        return {"step": extras.step}

    def summary_line(self, summary: Mapping[str, Any], options: ImportOptions,
                     size: Callable[[int], str]) -> str:
        s, src, dst = summary, options.src, options.dst
        if options.ranks is None:
            return (f"imported {src} -> {dst}: {s['tensors']} tensors, {s['values']} other "
                    f"values, {size(s['bytes'])}")
        return (f"imported {src} -> {dst}: {s['params']} parameters, {s['units']} units, "
                f"{options.ranks} ranks, {size(s['bytes'])}")


DCP = DcpImporter()
