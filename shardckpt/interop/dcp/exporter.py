"""The ``dcp`` exporter: any shardckpt checkpoint as a directory stock ``dcp.load`` reads
(:mod:`shardckpt.interop.dcp.export` writes it). Light: nothing of the format's writing code is
imported until an export runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping

from shardckpt.interop.dcp.config import DEFAULT_FILE_BYTES
from shardckpt.interop.exporter import ExportOptions, ExporterConfig, Progress
from shardckpt.storage import DEFAULT_BATCH


@dataclass(frozen=True, slots=True)
class DcpExportConfig(ExporterConfig):
    """The state-dict keys flat groups are written under, the most bytes of one DCP chunk (a
    larger box is written as several) and of one payload file."""

    model_key: str = field(default="model", metadata={
        "help": "Flat groups: the state-dict key the model is written under."})
    optim_key: str = field(default="optim", metadata={
        "help": "Flat groups: the state-dict key the optimizer is written under."})
    block_bytes: int = field(default=DEFAULT_BATCH, metadata={
        "flag": "--buffer", "bytes": "32MB",
        "help": "Most bytes of one DCP chunk: a larger box is written as several (bounds memory)."})
    file_bytes: int = field(default=DEFAULT_FILE_BYTES, metadata={
        "flag": "--file-size", "bytes": "1GiB",
        "help": "Start a new .distcp file once one holds this many bytes."})


class DcpExporter:
    name = "dcp"
    Config = DcpExportConfig
    help = "Write SRC as a directory stock dcp.load reads (.metadata and __<n>_0.distcp); .metadata last."
    source_help = "shardckpt checkpoint (path or fsspec URL)."
    destination_help = "Folder to write for DCP's FileSystemReader (must not hold a .metadata)."

    def export(self, options: ExportOptions, progress: Progress | None = None) -> dict[str, Any]:
        from shardckpt.interop.dcp.export import export_dcp

        c = options.config
        assert isinstance(c, DcpExportConfig)
        return export_dcp(options.src, options.dst, options.storage_options,
                          options.dst_storage_options, c.model_key, c.optim_key, c.block_bytes,
                          c.file_bytes)

    def summary_line(self, summary: Mapping[str, Any], options: ExportOptions,
                     size: Callable[[int], str]) -> str:
        s = summary
        return (f"exported {options.src} -> {options.dst}: {s['tensors']} tensors, {s['values']} "
                f"other values, {len(s['files'])} files, {size(s['bytes'])}")


DCP = DcpExporter()
