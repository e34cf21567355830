"""How the processes of a job split the output files: by bytes, the same way on every process.

Pure: no I/O. Every process of a ``torchrun`` job (and every ``--workers`` process) computes the
same split from the same manifest, so no process has to send the plan to the others.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Mapping, Sequence

from shardckpt.format.dtypes import itemsize

from shardckpt.format.reshard_plan import ReshardPlan
from shardckpt.format.manifest import shard_slots

if TYPE_CHECKING:
    from shardckpt.checkpoint.writer import CheckpointSpec


def shard_bytes(spec: "CheckpointSpec", plans: Mapping[str, ReshardPlan]) -> list[tuple[int, int]]:
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


def balance(costs: Sequence[int], k: int) -> list[list[int]]:
    """Split items ``0..len(costs)-1`` into ``k`` lists of about equal total cost: the largest
    item first, each to the least loaded list (ties: the lower index); each list sorted. Pure."""
    loads = [(0, 0, w) for w in range(k)]  # (load, items, list index), a heap
    heapq.heapify(loads)
    out: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, n, w = heapq.heappop(loads)
        out[w].append(i)
        heapq.heappush(loads, (load + costs[i], n + 1, w))
    return [sorted(x) for x in out]



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
