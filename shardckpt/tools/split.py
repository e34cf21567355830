"""How the processes of a job split the output files: by bytes, the same way on every process.

Pure: no I/O. Every process of a ``torchrun`` job computes the same split from the same manifest,
so no process has to send the plan to the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Mapping

from shardckpt.checkpoint.job import balance
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import shard_slots
from shardckpt.format.reshard_plan import ReshardPlan

__all__ = ["balance", "contiguous_split", "shard_bytes"]

if TYPE_CHECKING:
    from shardckpt.checkpoint.writer import CheckpointSpec


def shard_bytes(spec: CheckpointSpec, plans: Mapping[str, ReshardPlan]) -> list[tuple[int, int]]:
    """(bytes read, bytes written) of each target shard file, headers aside. Pure."""
    slots = shard_slots(spec.components, spec.mesh)
    per_elem: dict[str, int] = {}
    for s in slots:
        group = s.name.rsplit(".", 1)[0]
        per_elem[group] = per_elem.get(group, 0) + itemsize(s.dtype)
    written = slots[-1].end if slots else 0
    read = [0] * spec.mesh.shard_degree
    for plan in plans.values():
        for c in plan.copies:
            read[c.dst_shard] += c.numel * per_elem.get(c.dst_group, 0)
    return [(r, written) for r in read]


def contiguous_split(costs: list[int], k: int) -> list[range]:
    """``k`` runs of consecutive items of about equal total cost (reads stay in file order): an
    item goes to the first run whose share of the total its midpoint falls in. Pure."""
    total, out, start, acc = sum(costs), [], 0, 0
    for w in range(k):
        goal = total * (w + 1) / k
        end = start
        while end < len(costs) and (acc + costs[end] / 2 <= goal or w == k - 1):
            acc += costs[end]
            end += 1
        out.append(range(start, end))
        start = end
    return out
