"""The boxes of a DCP load plan into the planner's tensors' own memory
(:func:`~shardckpt.checkpoint.tensor_reads.fill_tensors`): for
:class:`shardckpt.interop.dcp.storage.ShardckptReader`.

A box that is one contiguous run of its stored chunk (whole rows of it), loaded into a
contiguous tensor of the stored dtype, takes one of two paths. Into a CPU tensor from a local
disk it is read straight into the tensor's memory, every chunk it touches checked (no buffer, no
copy). Into a tensor on a device (or any tensor with ``pipeline=True`` or
``SHARDCKPT_IO_PIPELINE=1``) it is read into the ring of host buffers (pinned where the tensor is
on CUDA), each chunk's CRC32C checked in worker threads, and copied into the tensor's own memory
(``non_blocking`` on a side stream on CUDA) while the next reads run: bounded host memory, read,
check and copy overlapped. With ``pipeline=False`` neither. Any other box (a strided part of its
chunk, another dtype, a tensor without memory of its own layout, a CPU tensor from an object
store) is read in one batch and copied from a strided view of it
(:func:`~shardckpt.interop.dcp.read_items.box_tensor`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlanner

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.tensor_reads import fill_tensors
from shardckpt.format.dtypes import itemsize
from shardckpt.interop.dcp.read_items import box_tensor
from shardckpt.storage import IOConfig, local_path


def through_pipeline(target: Any, dtype: str, span: int, pipeline: bool | None,
                     config: IOConfig, local: bool = False) -> bool:
    """Whether the box of ``span`` stored bytes of ``dtype`` goes into ``target`` by
    :func:`~shardckpt.checkpoint.tensor_reads.fill_tensors` (see the module docstring); ``local``:
    its file is on a local disk."""
    if pipeline is False or type(target) is not torch.Tensor or not target.is_contiguous():
        return False
    if str(target.dtype).removeprefix("torch.") != dtype or not target.numel():
        return False
    if target.numel() * itemsize(dtype) != span:  # strided in its chunk
        return False
    return bool(pipeline) or config.every_device or target.device.type != "cpu" or local


def apply_boxes_pipelined(r: CheckpointReader, batch: list, planner: LoadPlanner, workers: int,
                          pipeline: bool | None) -> None:
    """Read ``batch`` ((item, (file, start, end), (tensor, chunk))) into the planner's tensors,
    each committed once its bytes are in."""
    if not batch:
        return
    cfg = IOConfig.from_env()
    piped: list[tuple[Any, tuple[Any, int, int], Any]] = []
    rest: list[tuple[Any, tuple[Any, int, int], Any, Any]] = []
    local: dict[str, bool] = {}  # per file, not per box
    for item, req, (t, chunk) in batch:
        target = planner.resolve_tensor(item)
        path = req[0].path
        if path not in local:
            local[path] = local_path(r.files.locate(path)[0].url) is not None
        if through_pipeline(target, t.dtype, req[2] - req[1], pipeline, cfg, local[path]):
            piped.append((item, req, target))
        else:
            rest.append((item, req, (t, chunk), target))
    if piped:
        for entry in {req[0].path: req[0] for _, req, _ in piped}.values():
            r.check_file(entry)
        fill_tensors(r, [req for _, req, _ in piped],
                     [(target, 0, target.numel()) for _, _, target in piped],
                     replace(cfg, every_device=True) if pipeline else cfg)
        for item, _, target in piped:
            planner.commit_tensor(item, target)
    if rest:
        views = r.read_ranges([req for _, req, _, _ in rest], workers=workers)
        for (item, _, (t, chunk), target), view in zip(rest, views, strict=True):
            target.copy_(box_tensor(view, t.dtype, chunk, item.lengths))
            planner.commit_tensor(item, target)
