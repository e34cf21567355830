"""The ``deepspeed`` exporter: a checkpoint of flat groups as the folder DeepSpeed's
``engine.load_checkpoint`` reads (:mod:`shardckpt.interop.deepspeed.export` writes it). Light:
nothing of the format's writing code (nor torch) is imported until an export runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping

from shardckpt.interop.exporter import ExportOptions, ExporterConfig, Progress


@dataclass(frozen=True, slots=True)
class DeepSpeedExportConfig(ExporterConfig):
    """The DeepSpeed job that is to load it: its data-parallel world (``ranks``, required) and
    ZeRO ``stage``; the ``tag`` folder (None: ``global_step<step>``); ``bf16``: files named and
    the module written as a bf16 run's."""

    ranks: int = field(metadata={"help": "Data-parallel world of the DeepSpeed job."})
    stage: int = field(default=2, metadata={"help": "ZeRO stage of the DeepSpeed job: 1, 2 or 3."})
    tag: str | None = field(default=None, metadata={"help": "Tag folder (default: global_step<step>)."})
    bf16: bool = field(default=False, metadata={
        "help": "Name the files and write the module as a bf16 run does."})


class DeepSpeedExporter:
    name = "deepspeed"
    Config = DeepSpeedExportConfig
    help = "Write SRC as DeepSpeed's save_checkpoint would for ZeRO --stage at --ranks; latest last."
    source_help = "shardckpt checkpoint of flat groups (path or fsspec URL)."
    destination_help = ("Folder for DeepSpeed's engine.load_checkpoint (the tag folder must be "
                        "empty; 'latest' is written last).")

    def export(self, options: ExportOptions, progress: Progress | None = None) -> dict[str, Any]:
        from shardckpt.interop.deepspeed.export import export_deepspeed

        c = options.config
        assert isinstance(c, DeepSpeedExportConfig)
        return export_deepspeed(options.src, options.dst, c.ranks, c.stage, c.tag, c.bf16,
                                options.storage_options, options.dst_storage_options,
                                progress=progress)

    def summary_line(self, summary: Mapping[str, Any], options: ExportOptions,
                     size: Callable[[int], str]) -> str:
        s = summary
        return (f"exported {options.src} -> {options.dst}/{s['tag']}: ZeRO-{s['stage']}, "
                f"{s['ranks']} ranks, {s['params']} parameters, {len(s['files'])} files, "
                f"{size(s['bytes'])}")


DEEPSPEED = DeepSpeedExporter()
