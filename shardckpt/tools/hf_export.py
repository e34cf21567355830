"""The ``hf`` exporter: a shardckpt checkpoint as a Hugging Face model folder
(``model-*.safetensors``, their index, ``config.json``): ``consolidate``
(:func:`shardckpt.tools.jobs.run_consolidate`) behind the :class:`~shardckpt.interop.exporter.Exporter`
interface, one process alone; a run directory means the checkpoint its ``latest`` names.
``shardckpt consolidate`` is the same export with ``torchrun`` shares and signing. Light:
nothing of consolidate (nor numpy) is imported until an export runs."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from shardckpt.interop.exporter import ExportOptions, ExporterConfig, Progress
from shardckpt.storage import DEFAULT_BUFFER

#: consolidate's largest output file (:data:`shardckpt.tools.consolidate_plan.DEFAULT_MAX_SHARD_SIZE`,
#: ``save_pretrained``'s 5 GB), not imported from there: that module loads numpy
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000

if TYPE_CHECKING:
    from shardckpt.tools.consolidate import ConsolidateResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HFExportConfig(ExporterConfig):
    """``consolidate``'s options: the output dtype and largest file, the component, the name
    prefix of chunked tensors, optimizer states and persistent buffers too, replacing files
    already there, a model folder to copy tokenizer files from, and the read buffer."""

    dtype: str = field(default="bf16", metadata={"help": "bf16 | fp16 | fp32 (floating tensors)."})
    max_shard_size: int = field(default=DEFAULT_MAX_SHARD_SIZE, metadata={
        "bytes": "5GB", "help": "Largest output file: 5GB, 500MB, 1e9."})
    component: str = field(default="model", metadata={"help": "Which component to export."})
    prefix: str | None = field(default=None, metadata={
        "help": "Chunked (DCP) checkpoints: export the tensors whose name starts with this, named "
                "without it (default: the one the writer recorded)."})
    optimizer: bool = field(default=False, metadata={"help": "Also write optimizer states (fp32)."})
    overwrite: bool = field(default=False, metadata={
        "help": "Replace consolidated files already in DST."})
    copy_from: str | None = field(default=None, metadata={
        "help": "Model folder (path or fsspec URL) whose tokenizer and generation files (and "
                "config.json, if the checkpoint has none) are copied."})
    buffer_bytes: int = field(default=DEFAULT_BUFFER, metadata={
        "flag": "--buffer", "bytes": "64MB", "help": "Bytes held in memory at a time (bounds memory)."})
    keep_buffers: bool = field(default=False, metadata={
        "help": "Also write the persistent buffers (left out by default)."})


def consolidation_summary(r: ConsolidateResult, src: str, dst: str) -> dict[str, Any]:
    """What a consolidation wrote, as plain data (``consolidate --json``, ``export hf --json``)."""
    return {"src": src, "dst": dst, "save_id": r.save_id, "step": r.step, "dtype": r.dtype,
            "component": r.component, "tensors": r.tensors, "total_size": r.total_size,
            "files": [{"name": n, "size": s} for n, s in r.files],
            "optimizer_files": [{"name": n, "size": s} for n, s in r.optimizer_files],
            "omitted_aliases": dict(r.omitted_aliases),
            "left_out_buffers": list(r.left_out_buffers), "bytes_read": r.bytes_read,
            "bytes_written": r.bytes_written, "seconds": round(r.seconds, 3)}


class HFExporter:
    name = "hf"
    Config = HFExportConfig
    help = "Write SRC as Hugging Face safetensors (and config.json) in DST; its index is written last."
    source_help = "shardckpt checkpoint or run directory (path or fsspec URL)."
    destination_help = "Output directory (path or fsspec URL)."

    def export(self, options: ExportOptions, progress: Progress | None = None) -> dict[str, Any]:
        from shardckpt.checkpoint.locate import locate_checkpoint
        from shardckpt.tools.jobs import run_consolidate

        c = options.config
        assert isinstance(c, HFExportConfig)
        opts = options.storage_options
        where = locate_checkpoint(options.src, opts)  # a run directory: the checkpoint latest names
        if where.note:
            log.info("%s", where.note)

        def show(total: int) -> Any:
            return progress(total, "export hf") if progress is not None else nullcontext(lambda n: None)

        r = run_consolidate(where.storage, options.dst, c.dtype, c.max_shard_size, c.component,
                            c.prefix, c.optimizer, c.overwrite, c.copy_from, opts, c.buffer_bytes,
                            None, show, c.keep_buffers)
        return consolidation_summary(r, where.url, options.dst)

    def summary_line(self, summary: Mapping[str, Any], options: ExportOptions,
                     size: Callable[[int], str]) -> str:
        s = summary
        extra = f" + {len(s['optimizer_files'])} optimizer files" if s["optimizer_files"] else ""
        return (f"exported {options.src} -> {options.dst}: {s['tensors']} tensors ({s['dtype']}) in "
                f"{len(s['files'])} files{extra}, {size(s['bytes_written'])}")


HF = HFExporter()
