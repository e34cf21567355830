"""ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", 2023): three independent options of :class:`~shardckpt.runtime.engine.ZeroEngine` that
cut cross-node traffic. They change bytes moved and bytes resident, never the fp32 masters, the
optimizer state or the checkpoint format.

* **qwZ** (``qwz``): each rank quantizes its weight shard blockwise to int8 (one fp32 scale per
  ``block_size`` elements, :mod:`shardckpt.runtime.quant`) before the all-gather and every rank
  dequantizes the whole group after it, into the compute dtype. Every rank computes with the same
  dequantized weights (its own shard included); each differs from the master by at most
  ``absmax(block) / 254``. A gather moves ``S * (s + 4 * ceil(s / block_size))`` bytes instead of
  ``S * s`` compute-dtype elements.
* **hpZ** (``hpz``, stage 3): after a unit's forward gather (with gradients enabled) each rank keeps
  its ``1/K`` slice of the gathered weights (``K`` = ranks per node), so the backward gather is an
  all-gather inside the node of those slices: a byte copy of the forward's weights, no cross-node
  traffic. Memory: each unit's weights / K per rank, from its forward to the end of the backward
  (or the next optimizer step); units that stay gathered (the root by default) keep none.
* **qgZ** (``qgz``): gradients are reduced hierarchically: the local gradient's ``W`` slices are
  quantized blockwise (int4 or int8, ``grad_bits``) and exchanged by an all-to-all inside the node
  (each rank receives, from every rank of its node, the slices whose shard ranks share its local
  index), dequantized and summed in fp32 in local-rank order; the node sums are quantized again
  and exchanged by an all-to-all across nodes (ranks with the same local index), dequantized,
  summed in fp32 in node order and divided by the world size. Each rank receives its shard of the
  mean gradient. The order of every sum is fixed, so the result does not depend on the backend.
  A stage with one participant (one rank per node, or one node) moves and quantizes nothing.

Nodes are blocks of ``ranks_per_node`` consecutive ranks
(:attr:`~shardckpt.runtime.mesh.ProcessMesh.ranks_per_node`, torchrun's ``LOCAL_WORLD_SIZE``).
hpZ and qgZ need the world size to be a multiple of it. ZeRO++ runs on a plain ZeRO mesh (R = 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from shardckpt.errors import ConfigError
from shardckpt.format.layout import SHARD_AXIS
from shardckpt.runtime import quant
from shardckpt.runtime.accounting import Accounting
from shardckpt.runtime.collectives import (FP32, PendingMean, _all_gather_single, _bytes,
                                           _record, collective_guard)
from shardckpt.runtime.mesh import ProcessMesh

#: qwZ's integer width (the paper's; int4 weights lose too much).
WEIGHT_BITS = 8


@dataclass(frozen=True, slots=True)
class ZeroPP:
    """Which ZeRO++ options are on (see the module docstring); all off by default.

    ``block_size``: elements per quantization block (one fp32 scale each), for qwZ and qgZ.
    ``grad_bits``: qgZ's integer width, 4 (the paper's) or 8.
    """

    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    block_size: int = 256
    grad_bits: int = 4

    def __post_init__(self) -> None:
        bad = [f"{name}={getattr(self, name)!r}" for name in ("qwz", "hpz", "qgz")
               if not isinstance(getattr(self, name), bool)]
        if bad:
            raise ConfigError(f"ZeroPP: {', '.join(bad)}; the options are True or False")
        b = self.block_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ConfigError(f"ZeroPP.block_size is {b!r}; it must be a whole number >= 1 "
                              "(elements per quantization block; 256 is the default)")
        if not isinstance(self.grad_bits, int) or self.grad_bits not in quant.BITS:
            raise ConfigError(f"ZeroPP.grad_bits is {self.grad_bits!r}; qgZ quantizes gradients "
                              f"to {' or '.join(map(str, quant.BITS))} bits")

    @property
    def enabled(self) -> bool:
        return self.qwz or self.hpz or self.qgz

    def describe(self) -> str:
        on = [n for n in ("qwz", "hpz", "qgz") if getattr(self, n)]
        return (f"ZeRO++ {'+'.join(on)} (block {self.block_size}, grads int{self.grad_bits})"
                if on else "ZeRO++ off")


def check_zeropp(cfg: ZeroPP, pm: ProcessMesh, stage: int,
                 sum_dtypes: Iterable[tuple[str, torch.dtype]]) -> None:
    """Refuse, in one :class:`ConfigError`, what these options cannot do on this engine.

    ``sum_dtypes``: (flat group, dtype its gradient is summed in) of every trained group.
    """
    if not isinstance(cfg, ZeroPP):
        raise ConfigError(f"zeropp is {cfg!r}; pass ZeroPP(qwz=..., hpz=..., qgz=...) or None")
    if not cfg.enabled:
        return
    problems = []
    if pm.mesh.replicate_degree > 1:
        problems.append(f"the mesh {pm.mesh.describe()} replicates shards (HSDP); ZeRO++ runs "
                        "on a plain ZeRO mesh (replicate=1)")
    if cfg.hpz and stage != 3:
        problems.append(f"hpz needs stage 3 (parameters sharded); the engine is stage {stage}")
    if (cfg.hpz or cfg.qgz) and pm.world_size % pm.node_size:
        problems.append(f"hpz/qgz need the world size ({pm.world_size}) to be a multiple of "
                        f"the node size (ranks_per_node={pm.node_size})")
    if cfg.qgz:
        wrong = [f"{name} ({str(dt).removeprefix('torch.')})" for name, dt in sum_dtypes
                 if dt != FP32]
        if wrong:
            problems.append(f"qgz dequantizes and reduces gradients in fp32, but these flat "
                            f"groups ask to reduce in another dtype: {', '.join(wrong[:3])}"
                            f"{'...' if len(wrong) > 3 else ''}; use "
                            "MixedPrecisionPolicy(reduce_dtype=torch.float32)")
    if problems:
        raise ConfigError(f"{cfg.describe()}: " + "; ".join(problems))


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
        _record(acct, "all_gather", wire, cross_node=pm.axis_spans_nodes(SHARD_AXIS),
                elements=full.numel())
        with collective_guard("quantized all-gather of a flat group (qwZ)", pm):
            work = _all_gather_single(wire, packed, pm.shard_group, async_op=True)

    def finish() -> None:
        full.view(S, s).copy_(quant.dequantize(wire.view(S, -1), s, WEIGHT_BITS, block,
                                               full.dtype))
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
    _record(acct, "all_gather", full, cross_node=False)
    with collective_guard("in-node all-gather of a flat group (hpZ)", pm):
        return _all_gather_single(_bytes(full), _bytes(secondary), node_group, async_op=True)


# ------------------------------------------------------------------------------------ qgZ


def start_qgz_mean(pm: ProcessMesh, grad: torch.Tensor, bits: int, block: int,
                   acct: Accounting | None = None) -> PendingMean:
    """qgZ: this rank's fp32 slice of the mean of ``grad`` over all ranks, reduced hierarchically
    through quantized all-to-alls (see the module docstring). The in-node exchange is issued
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
        _record(acct, "all_to_all", send, cross_node=False, elements=W * s)
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
        _record(acct, "all_to_all", send2, cross_node=True, elements=N * s)
        with collective_guard("quantized gradient exchange across nodes (qgZ)", pm):
            dist.all_to_all_single(recv2, send2, group=cross_group)
        parts2 = quant.dequantize(recv2.view(N, -1), s, bits, block)
        total = parts2[0].clone()
        for n in range(1, N):  # node order
            total.add_(parts2[n])
        return total.div_(W)

    return PendingMean(finish, work, keep, what, pm)
