"""The ``hf`` importer: a Hugging Face model folder as a weights-only checkpoint of flat groups
(:mod:`shardckpt.interop.hf.import_` reads and writes it). Light: nothing of the format's reading
code is imported until a source is read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from shardckpt.interop.hf.config import HFConfig, DEFAULT_UNITS
from shardckpt.interop.importer import (
    ImportOptions, ImportPlan, ImporterConfig, SourceInfo, file_bytes, write_flat,
)

if TYPE_CHECKING:
    from shardckpt.format.manifest import Manifest
    from shardckpt.format.records import RunExtras
    from shardckpt.checkpoint.job import Job


class HFImporter:
    name = "hf"
    Config = HFConfig
    help = "Write SRC's weights as a weights-only checkpoint for --ranks ranks; manifest last."
    source_help = "Hugging Face model folder, index or .safetensors file (path or fsspec URL)."
    ranks_help = None
    default_units = DEFAULT_UNITS
    origin = None  # the source's config.json is the checkpoint's own hf_config

    def splits(self, options: ImportOptions) -> bool:
        return True  # each process reads only the ranges of its own shard files

    def describe_source(self, src: Any, storage_options: Mapping[str, Any] | None = None,
                        config: ImporterConfig | None = None) -> SourceInfo:
        from shardckpt.interop.hf.source import HFSource, open_hf

        source = src if isinstance(src, HFSource) else open_hf(src, storage_options)
        return SourceInfo(self.name, source.url, tuple(source.files),
                          file_bytes(source.storage, source.files), len(source.tensors),
                          {"config": source.config is not None})

    def plan(self, options: ImportOptions) -> ImportPlan:
        from shardckpt.interop.hf.import_ import plan_hf

        return plan_hf(options)

    def write(self, plan: ImportPlan, job: Job | None = None) -> Manifest:
        return write_flat(plan, job)

    def summary(self, extras: RunExtras, dst: str) -> dict[str, Any]:
        return {"hf_config": extras.hf_config is not None}

    def summary_line(self, summary: Mapping[str, Any], options: ImportOptions,
                     size: Callable[[int], str]) -> str:
        s = summary
        return (f"imported {options.src} -> {options.dst}: {s['params']} tensors, {s['units']} "
                f"units, {options.ranks} ranks, {size(s['bytes'])}")


HF = HFImporter()
