"""The ZeRO++ collectives a flat group runs (:mod:`shardckpt.runtime.zeropp` has what they do):
qwZ's quantized all-gather, hpZ's secondary slice and in-node all-gather, qgZ's quantized
hierarchical gradient mean. Each is issued like the plain ones of
:mod:`shardckpt.runtime.collectives` (accounted, guarded, left in flight) and called on every rank
of its group in the same order.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardckpt.format.layout import SHARD_AXIS
from shardckpt.runtime.accounting import Accounting
from shardckpt.runtime.collectives import (FP32, PendingMean, all_gather_single, byte_view,
                                           collective_guard, record)
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.zeropp import quant

#: qwZ's integer width (the paper's; int4 weights lose too much).
WEIGHT_BITS = 8


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


# ------------------------------------------------------------------------------ qwZ / hpZ


def start_quantized_gather(pm: ProcessMesh, full: torch.Tensor, shard: torch.Tensor, block: int,
                           acct: Accounting | None = None
                           ) -> tuple[Any, tuple[torch.Tensor, ...], Callable[[], None]]:
    """qwZ: issue the all-gather of ``shard`` quantized to int8; returns (work handle, tensors
    to keep alive until it is done, the dequantization into ``full`` to run after the wait).
    Called on every rank of the shard group."""
    S, s = pm.shard_degree, shard.numel()
    packed = quant.quantize(shard.view(1, s), WEIGHT_BITS, block).view(-1)
    if S == 1:
        wire, work = packed, None
    else:
        wire = torch.empty(S * packed.numel(), dtype=torch.uint8, device=shard.device)
        record(acct, "all_gather", wire, cross_node=pm.axis_spans_nodes(SHARD_AXIS),
               elements=full.numel())
        with collective_guard("quantized all-gather of a flat group (qwZ)", pm):
            work = all_gather_single(wire, packed, pm.shard_group, async_op=True)

    def finish() -> None:
        quant.dequantize(wire.view(S, -1), s, WEIGHT_BITS, block, full.dtype,
                         out=full.view(S, s))
    return work, (packed, wire), finish


def node_slice(pm: ProcessMesh, full: torch.Tensor) -> torch.Tensor:
    """hpZ: a copy of this rank's ``1/K`` slice of the gathered ``full`` (its secondary)."""
    part = full.numel() // pm.node_size
    with torch.no_grad():
        return full[pm.node_rank * part:(pm.node_rank + 1) * part].clone()


def start_node_gather(pm: ProcessMesh, full: torch.Tensor, secondary: torch.Tensor,
                      acct: Accounting | None = None) -> Any:
    """hpZ: all-gather the node's secondary slices into ``full`` inside the node (a byte copy).
    Called on every rank of the node."""
    node_group = pm.node_groups()[0]
    if node_group is None:
        full.copy_(secondary)
        return None
    record(acct, "all_gather", full, cross_node=False)
    with collective_guard("in-node all-gather of a flat group (hpZ)", pm):
        return all_gather_single(byte_view(full), byte_view(secondary), node_group, async_op=True)


# ------------------------------------------------------------------------------------ qgZ


def start_qgz_mean(pm: ProcessMesh, grad: torch.Tensor, bits: int, block: int,
                   acct: Accounting | None = None) -> PendingMean:
    """qgZ: this rank's fp32 slice of the mean of ``grad`` over all ranks, reduced hierarchically
    through quantized all-to-alls (see :mod:`shardckpt.runtime.zeropp`). The in-node exchange is issued
    now; the cross-node one runs when :meth:`PendingMean.result` is asked for (every rank asks
    in the same order). Called on every rank."""
    W, K = pm.world_size, pm.node_size
    N = W // K
    s = grad.numel() // W
    rows = grad.view(W, s)
    if W == 1:
        return PendingMean(lambda: grad.to(FP32, copy=True))
    node_group, cross_group = pm.node_groups()
    what = "quantized gradient exchange inside the node (qgZ)"
    if K > 1:
        # to local rank k go the slices whose shard rank has local index k, in node order
        order = [n * K + k for k in range(K) for n in range(N)]
        send = quant.quantize(rows[order], bits, block).view(-1)
        recv = torch.empty_like(send)
        record(acct, "all_to_all", send, cross_node=False, elements=W * s)
        with collective_guard(what, pm):
            work = dist.all_to_all_single(recv, send, group=node_group, async_op=True)
        keep: tuple[torch.Tensor, ...] = (grad, send, recv)
    else:
        work, keep, recv = None, (grad,), None

    def finish() -> torch.Tensor:
        if recv is not None:
            parts = quant.dequantize(recv.view(W, -1), s, bits, block).view(K, N, s)
            acc = parts[0].clone()
            for k in range(1, K):  # local-rank order
                acc.add_(parts[k])
        else:
            acc = rows.to(FP32)  # one rank per node: its own gradient, slice n for node n
        if N == 1:
            return acc[0].div_(W)
        send2 = quant.quantize(acc, bits, block).view(-1)
        recv2 = torch.empty_like(send2)
        record(acct, "all_to_all", send2, cross_node=True, elements=N * s)
        with collective_guard("quantized gradient exchange across nodes (qgZ)", pm):
            dist.all_to_all_single(recv2, send2, group=cross_group)
        parts2 = quant.dequantize(recv2.view(N, -1), s, bits, block)
        total = parts2[0].clone()
        for n in range(1, N):  # node order
            total.add_(parts2[n])
        return total.div_(W)

    return PendingMean(finish, work, keep, what, pm)
