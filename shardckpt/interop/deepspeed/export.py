"""Export a shardckpt checkpoint (flat groups) as the folder DeepSpeed's ``engine.load_checkpoint``
reads, for ZeRO stage 1, 2 or 3 at N data-parallel ranks.

What is written, in ``DST/<tag>/`` (as DeepSpeed 0.19's ``engine.save_checkpoint`` writes it; the
committed fixtures under ``tests/fixtures/deepspeed`` are the reference):

* per rank ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: the rank's fp32 partitions
  (ZeRO-1/2 ``single_partition_of_fp32_groups``: each param group's trained parameters flattened,
  padded to a multiple of 2 x N, cut into N partitions, the last one's padding left off; ZeRO-3
  ``fp32_flat_groups``: piece r of ``ceil(numel / N)`` elements of every parameter, per sub-group),
  the wrapped ``torch.optim`` state dict (``exp_avg``, ``exp_avg_sq`` over the whole partition,
  padding zero; ``step``; the param groups), and the ZeRO optimizer's bookkeeping;
* ZeRO-1/2 ``mp_rank_00_model_states.pt``: the module state dict in the compute dtype (tied
  weights sharing storage), ``param_shapes``, ``frozen_param_shapes`` / ``frozen_param_fragments``
  (ZeRO-2), ``shared_params``, ``buffer_names``, steps, ``ds_config``, ``ds_version``;
* ZeRO-3 ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``: the same with empty placeholders for
  the parameters and each rank's piece of the frozen ones;

then ``DST/latest`` (the tag), last. A file DeepSpeed reads must be a pickle: these are written
with ``torch.save`` of plain containers and tensors, and the three DeepSpeed objects its loader
takes as they are (the loss scaler, which ZeRO-3 assigns without looking at it; the ZeRO stage
enum; the fragment addresses of ``param_slice_mappings``) are written as DeepSpeed pickles them,
naming DeepSpeed's classes without importing DeepSpeed (:mod:`.ds_pickle`, the only place
shardckpt writes such a pickle: ``docs/FORMAT.md`` section 14.2). What each file holds is planned
in :mod:`.export_plan`; this module writes them, as one attempt
(:mod:`shardckpt.checkpoint.attempt`).

Every source byte is read checked (CRC32C). Memory: the files of one rank at a time (one
partition of each state kind; for ZeRO-1/2 the model file holds the whole module, as DeepSpeed's
does). Files are created create-only; on any error those written are removed and ``latest`` is not
touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

from shardckpt.checkpoint.attempt import Attempt, ForeignFiles, Steps
from shardckpt.checkpoint.job import Job
from shardckpt.errors import ConfigError
from shardckpt.interop.deepspeed.ds_pickle import saved
from shardckpt.interop.deepspeed.export_plan import DS_VERSION, SUB_GROUP_SIZE, plan_export
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

__all__ = ["export_deepspeed", "DS_VERSION", "SUB_GROUP_SIZE"]

Progress = Callable[[int, str], AbstractContextManager[Callable[[int], None]]]


def export_deepspeed(src: str, dst: str, ranks: int, stage: int = 2, tag: str | None = None,
                     bf16: bool = False, storage_options: Mapping[str, Any] | None = None,
                     dst_storage_options: Mapping[str, Any] | None = None,
                     sub_group_size: int = SUB_GROUP_SIZE,
                     progress: Progress | None = None) -> dict[str, Any]:
    """Write flat-group checkpoint ``src`` at ``dst`` as DeepSpeed's ``engine.save_checkpoint``
    would for ZeRO ``stage`` at ``ranks`` data-parallel ranks: ``engine.load_checkpoint(dst)``
    of a DeepSpeed job of that world and stage (and ``shardckpt import deepspeed``) reads it.

    ``tag``: the tag folder (default ``global_step<step>``, DeepSpeed's own). ``bf16``: files
    named and the module written as a bf16 run's (DeepSpeed loads either into either).
    ``sub_group_size``: ZeRO-3's, as the loading job configures it. Refuses a tag folder that
    holds files; on any error the files written are removed and ``latest`` is left as it was.
    Returns a summary (destination, tag, stage, ranks, files, bytes, params).
    """
    plan = plan_export(src, ranks, stage, tag, bf16, storage_options, sub_group_size)
    out = Storage(dst, dst_storage_options)
    files = ForeignFiles(out)
    total = 0

    def guard() -> None:
        if out.exists(plan.tag) and out.ls(plan.tag):
            raise ConfigError(f"{out.url_of(plan.tag)} holds files; export into an empty tag folder")

    def write(files: ForeignFiles) -> None:
        nonlocal total
        with ExitStack() as stack:
            advance = (stack.enter_context(progress(len(plan.files), "export deepspeed"))
                       if progress is not None else stack.enter_context(nullcontext(lambda n: None)))
            for rel, build, note in plan.files:
                data = saved(build())
                files.create(rel, data)
                total += len(data)
                advance(1)
                if note:
                    log.info("%s", note)

    # the commit: ``latest`` names the tag, last
    attempt = Attempt(Job.single(), out.url, Steps.named("export deepspeed"), lambda _: files,
                      guard=guard)
    attempt.run(write, lambda f, _: out.put("latest", plan.tag.encode("utf-8")))
    log.info("exported %s -> %s (ZeRO-%d, %d ranks, %d files, %d bytes)", plan.reader.url, out.url,
             stage, ranks, len(files.written), total)
    return {"destination": out.url, "tag": plan.tag, "stage": stage, "ranks": ranks,
            "precision": "bf16" if bf16 else "fp32", "step": plan.step, "params": plan.params,
            "files": files.written + ["latest"], "bytes": total}
