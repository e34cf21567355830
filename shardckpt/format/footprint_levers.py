"""The levers beyond ZeRO-3, estimated per rank: ZeRO++ traffic and optimizer offload.

ZeRO++ (Wang et al. 2023; :func:`zeropp_traffic`): the bytes one rank moves per ZeRO-3 step,
cross-node and in-node, with quantized weight gathers (qwZ), an in-node secondary weight copy
for the backward gather (hpZ, Ψ·p/K bytes per rank) and quantized hierarchical gradient
reduction (qgZ), for nodes of K ranks. Optimizer offload (:func:`offload_split`): where a row
of :func:`shardckpt.format.footprint_math.estimate_all` keeps its model state with the optimizer in
host memory or on disk.

Pure arithmetic, in the conventions of :mod:`shardckpt.format.footprint_math`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardckpt.format.footprint_math import (
    SHARDED, Estimate, EstimateError, check_count, fields_dict, precision_preset,
)

# ------------------------------------------------------------------------------------ ZeRO++

ZEROPP_VARIANTS = ("zero3", "qwz", "hpz", "qgz", "zeropp")
_ZEROPP_LABEL = {"zero3": "ZeRO-3", "qwz": "+ qwZ", "hpz": "+ hpZ", "qgz": "+ qgZ",
                 "zeropp": "ZeRO++ (all three)"}


@dataclass(frozen=True, slots=True)
class ZeroPPTraffic:
    """Bytes one rank moves per ZeRO-3 step with some ZeRO++ options, split by where they go.

    Logical volume in bytes (the convention of :attr:`Estimate.comm_elements`: an all-gather
    counts its output, a reduce-scatter or an all-to-all its input), counted as cross-node when
    the collective's group spans nodes. ``secondary_bytes``: hpZ's in-node copy of the weights
    per rank (Ψ · p / K), held from forward to backward.
    """

    variant: str          # zero3 | qwz | hpz | qgz | zeropp
    label: str
    cross_node_bytes: float
    in_node_bytes: float
    secondary_bytes: float
    vs_zero3: float       # ZeRO-3's cross-node bytes over this variant's (inf when 0)

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def zeropp_traffic(params: int, ranks: int, ranks_per_node: int, *,
                   precision: str = "fsdp2-bf16", block_size: int = 256,
                   grad_bits: int = 4) -> tuple[ZeroPPTraffic, ...]:
    """Per-rank traffic of one ZeRO-3 step, alone and with each ZeRO++ option and all three.

    With Ψ = ``params``, K = ``ranks_per_node``, N = ``ranks`` / K nodes, p / g the precision's
    bytes per parameter of the compute copy / gradient, B = ``block_size``, b = ``grad_bits``:

    * a weight all-gather moves Ψ·p bytes, with qwZ Ψ·(1 + 4/B) (int8, an fp32 scale per block);
      forward and backward each gather once; with hpZ the backward's runs inside the node (Ψ·p);
    * the gradient reduce-scatter moves Ψ·g; with qgZ an in-node all-to-all of Ψ·(b/8 + 4/B)
      and a cross-node one of Ψ/K·(b/8 + 4/B);
    * with one node (K = ``ranks``) nothing is cross-node.

    Padding and the root unit (which stays gathered between forward and backward) are left out.
    """
    psi = check_count("params", params)
    n = check_count("ranks", ranks)
    k = check_count("ranks_per_node", ranks_per_node)
    block = check_count("block_size", block_size)
    if n % k:
        raise EstimateError("ranks_per_node", k, f"must divide ranks = {n}")
    if grad_bits not in (4, 8) or isinstance(grad_bits, bool):
        raise EstimateError("grad_bits", grad_bits, "qgZ quantizes gradients to 4 or 8 bits")
    prec = precision_preset(precision)
    p, g = prec.params, prec.grads
    multi = n // k > 1
    gather_q = psi * (1 + 4 / block)
    grad_q = psi * (grad_bits / 8 + 4 / block)
    rows = []
    base = 0.0
    for variant in ZEROPP_VARIANTS:
        qwz = variant in ("qwz", "zeropp")
        hpz = variant in ("hpz", "zeropp")
        qgz = variant in ("qgz", "zeropp")
        gather = gather_q if qwz else float(psi * p)
        cross = gather + (0.0 if hpz else gather)
        local = float(psi * p) if hpz else 0.0
        if qgz:
            local += grad_q if k > 1 else 0.0
            cross += grad_q / k
        else:
            cross += float(psi * g)
        if not multi:
            cross, local = 0.0, cross + local
        if variant == "zero3":
            base = cross
        rows.append(ZeroPPTraffic(variant, _ZEROPP_LABEL[variant], cross, local,
                                  psi * p / k if hpz else 0.0,
                                  base / cross if cross else math.inf))
    return tuple(rows)


# --------------------------------------------------------------------- optimizer offload

OFFLOAD_MODES = ("cpu", "nvme")
#: Groups whose master and state an ``nvme`` step holds in host memory at once: the one
#: computing, the one being read ahead, the one being written back.
OFFLOAD_WINDOW_GROUPS = 3
#: Slots of the pipelined step's host ring (:mod:`shardckpt.runtime.offload.pipeline`), each
#: one group's fp32 gradient and its updated weights in the device shard's dtype.
OFFLOAD_RING_GROUPS = 2


@dataclass(frozen=True, slots=True)
class OffloadSplit:
    """Model-state bytes per rank with the optimizer offloaded (shardckpt's runtime:
    ``offload_optimizer``): the per-element optimizer state and an fp32 master copy, ``(4 +
    optim) · Ψ / S``, leave the device, which keeps its gradients and its weight shard, in the
    compute dtype (``p · Ψ / S``) when that is narrower than the master's: the shard the
    all-gathers read and the host step casts the master into. Where the precision holds
    sharded parameters (``paper`` at ZeRO-3: fp16 params and grads, 4Ψ/N as in ZeRO-Offload),
    that shard *is* the params kind and is not counted twice; where the compute copy is
    gathered per unit (``fsdp2-bf16`` at ZeRO-3: the shard and fp32 grads, 6Ψ/N) or replicated
    (ZeRO-1/2: the whole copy and, beside it, the shard, as the runtime keeps them), the shard
    is added. ``cpu``: host memory
    holds them; ``nvme``: the disk does, and host memory holds the streaming window of
    :data:`OFFLOAD_WINDOW_GROUPS` groups of the largest unit's shard (0 when ``largest_unit`` is
    unknown). Host memory also holds the reduced fp32 gradients on their way: by default the
    pipelined step's ring, :data:`OFFLOAD_RING_GROUPS` slots of the largest unit's shard, each
    its fp32 gradient and its updated weights in the shard's dtype; when the step overlaps
    backward (``offload_overlap_step``), one fp32 buffer of the largest unit's shard; with the
    unpipelined step (``pipeline=False``), a copy of every group's shard made in backward
    (``4 · Ψ / S``)."""

    mode: str
    strategy: str
    label: str
    device_bytes: float
    host_bytes: float
    disk_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def offload_split(row: Estimate, mode: str, overlap_step: bool = False,
                  pipeline: bool = True) -> OffloadSplit:
    """Where ``row``'s model state lives per rank with ``offload_optimizer=mode`` (and
    ``offload_overlap_step``; ``pipeline``: ``OffloadConfig.pipeline``)."""
    if mode not in OFFLOAD_MODES:
        raise EstimateError("offload", mode, f"unknown; known: {', '.join(OFFLOAD_MODES)}")
    if row.strategy == "ddp":
        raise EstimateError("strategy", "ddp", "offload applies to ZeRO-1/2/3 and HSDP")
    optim, master, params = row.kind("optim"), row.kind("master"), row.kind("params")
    p = params.bytes_per_param
    per_param = 4 + optim.bytes_per_param  # fp32 master copy + per-element state
    moved = per_param * row.params / row.shard
    device = row.model_state_bytes - optim.bytes
    if p < master.bytes_per_param:  # the device keeps the compute-dtype shard alone
        device -= master.bytes
        if params.placement != SHARDED:  # else the held params shard is that shard already
            device += p * row.params / row.shard
    unit = (row.largest_unit or 0) / row.shard
    shard = p if 0 < p < 4 else 4  # bytes per element of the device shard the step writes
    if overlap_step:
        grads = 4 * unit
    elif pipeline:
        grads = OFFLOAD_RING_GROUPS * (4 + shard) * unit
    else:
        grads = 4 * row.params / row.shard
    if mode == "cpu":
        return OffloadSplit(mode, row.strategy, row.label, device, moved + grads, 0.0)
    window = OFFLOAD_WINDOW_GROUPS * per_param * unit + grads
    return OffloadSplit(mode, row.strategy, row.label, device, window, moved)
