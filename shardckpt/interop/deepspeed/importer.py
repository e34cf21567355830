"""The ``deepspeed`` importer: a DeepSpeed ZeRO-1/2/3 checkpoint (weights, Adam state, buffers)
as flat groups (:mod:`shardckpt.interop.deepspeed.import_` reads and writes it). Light: nothing
of the format's reading code (nor torch) is imported until a source is read."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from shardckpt.interop.deepspeed.config import DeepSpeedConfig, DeepSpeedOrigin
from shardckpt.interop.importer import (
    ImportOptions, ImportPlan, ImporterConfig, SourceInfo, file_bytes, write_flat,
)
from shardckpt.interop.importing import BLOCK_UNITS

if TYPE_CHECKING:
    from shardckpt.format.manifest import Manifest
    from shardckpt.format.records import RunExtras
    from shardckpt.checkpoint.job import Job

log = logging.getLogger("shardckpt.interop.deepspeed.import_")


class DeepSpeedImporter:
    name = "deepspeed"
    Config = DeepSpeedConfig
    help = "Write a DeepSpeed ZeRO-1/2/3 checkpoint (weights, Adam state, buffers) for --ranks ranks."
    source_help = ("Folder DeepSpeed's engine.save_checkpoint wrote (holds 'latest' and the tag "
                   "folders), or one tag folder (global_step100); path or fsspec URL.")
    ranks_help = None
    default_units = BLOCK_UNITS
    origin = DeepSpeedOrigin

    def splits(self, options: ImportOptions) -> bool:
        # every process stages the source (each target shard takes a piece of every DeepSpeed
        # partition) and writes its share of the target files
        return True

    def describe_source(self, src: Any, storage_options: Mapping[str, Any] | None = None,
                        config: ImporterConfig | None = None) -> SourceInfo:
        from shardckpt.checkpoint.reader import as_storage
        from shardckpt.interop.deepspeed.files import find_files, tag_folder_source

        tag = config.tag if isinstance(config, DeepSpeedConfig) else None
        storage, tag = tag_folder_source(as_storage(src, storage_options), tag)
        tag, optim, models = find_files(storage, tag)
        files = tuple(models) + tuple(optim)
        return SourceInfo(self.name, storage.url, files, file_bytes(storage, files), None,
                          {"tag": tag, "world_size": len(optim)})

    def plan(self, options: ImportOptions) -> ImportPlan:
        from shardckpt.interop.deepspeed.import_ import plan_deepspeed

        return plan_deepspeed(options)

    def write(self, plan: ImportPlan, job: Job | None = None) -> Manifest:
        m = write_flat(plan, job)
        source = plan.state
        log.info("imported %s (ZeRO-%d, %d ranks) -> %s (%d ranks)", source.url, source.stage,
                 source.world_size, plan.out.url, plan.spec.mesh.world_size)
        return m

    def summary(self, extras: RunExtras, dst: str) -> dict[str, Any]:
        ds = extras.origin(DeepSpeedOrigin, dst) or DeepSpeedOrigin()
        return {"step": extras.step, "zero_stage": ds.stage, "source_world_size": ds.world_size}

    def summary_line(self, summary: Mapping[str, Any], options: ImportOptions,
                     size: Callable[[int], str]) -> str:
        s = summary
        return (f"imported {options.src} (ZeRO-{s['zero_stage']}, {s['source_world_size']} "
                f"ranks, step {s['step']}) -> {options.dst}: {s['params']} parameters, "
                f"{options.ranks} ranks, {size(s['bytes'])}")


DEEPSPEED = DeepSpeedImporter()
