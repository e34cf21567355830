"""The collectives of the ZeRO runtime: all-gather a shard, reduce-scatter a gradient.

Every function here is called on every rank of the group it uses, in the same order, and moves
whole flat groups (1-D, contiguous, padded to a multiple of ``16 * S``). A failure inside
``torch.distributed`` (a peer that died, a process-group timeout) becomes a
:class:`~shardckpt.errors.CollectiveError` naming the operation and this rank.

``torch.distributed`` functions are looked up at call time, so a test can wrap them to count bytes.

Deterministic reduction (DESIGN.md, "Deterministic mode"): rank ``r`` receives every rank's slice
``r`` of the gradient through one all-to-all (same volume as a reduce-scatter), then sums them in
global rank order and divides by the world size: ``(((g0 + g1) + g2) + ...) / W``, in fp32 unless
a mixed-precision policy asks for another ``sum_dtype``. The result does not depend on the
backend's reduction order, so it equals a single-process reference. Every ZeRO stage (1, 2
and 3) reduces gradients with :func:`reduce_scatter_mean`: each rank needs only the mean of the
slice its optimizer updates, so stage 1 also sends Ψ for its gradients (not an all-reduce's 2Ψ).

Gradient reductions can be issued asynchronously (:func:`start_reduce_scatter_mean`, which returns
a :class:`PendingMean`): the exchange runs on the backend's threads while backward computes the
next unit, and the rank-order sum (or the division by the world size) runs when the result is
asked for, with the same bits as the synchronous :func:`reduce_scatter_mean`.

Every function takes an optional :class:`~shardckpt.runtime.accounting.Accounting` and records
the logical volume of each collective it issues there (none for a group of one rank).
:func:`all_gather_shard` can also be issued asynchronously (prefetch); it then returns the
backend's work handle, which the caller must wait on before reading or freeing ``full``. Each
record says whether the collective's group spans nodes (``ProcessMesh.ranks_per_node``).

The ZeRO++ variants (quantized all-gather, in-node all-gather, quantized hierarchical gradient
reduction) are in :mod:`shardckpt.runtime.zeropp` and follow the same rules.
"""

from __future__ import annotations

import contextlib
from typing import Any
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardckpt.errors import CollectiveError
from shardckpt.runtime.accounting import Accounting
from shardckpt.format.layout import REPLICATE_AXIS, SHARD_AXIS
from shardckpt.runtime.mesh import ProcessMesh

FP32 = torch.float32


@contextlib.contextmanager
def collective_guard(op: str, pm: ProcessMesh) -> Iterator[None]:
    """Turn a failure of the wrapped ``torch.distributed`` call into a :class:`CollectiveError`."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # DistBackendError, gloo timeouts, closed pairs
        raise CollectiveError(
            f"{op} failed on rank {pm.rank} of {pm.world_size}: {exc}. Another rank probably "
            f"raised or stalled (the process-group timeout is {pm.timeout_s:g}s); that rank's "
            "own error says why.",
            {pm.rank: f"{type(exc).__name__}: {exc}"},
        ) from exc


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor as raw bytes (so any dtype travels through any backend)."""
    return t.view(torch.uint8)


def record(acct: Accounting | None, op: str, t: torch.Tensor, factor: int = 1,
           cross_node: bool = False, elements: int | None = None) -> None:
    """Count collective ``op`` moving ``t`` (``factor`` times) in ``acct``, where there is one."""
    if acct is not None:
        acct.record(op, t, factor, cross_node=cross_node, elements=elements)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: object,
                      async_op: bool = False) -> Any:
    """Gather every rank's ``inp`` of ``group`` into ``out`` (rank order), through the
    single-tensor all-gather this torch has."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group: object,
                           async_op: bool = False) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_shard(pm: ProcessMesh, full: torch.Tensor, shard: torch.Tensor, *,
                     async_op: bool = False, acct: Accounting | None = None) -> Any:
    """Fill ``full`` (``S * s`` elements) with every shard rank's ``shard`` (``s`` elements), in order.

    A byte copy: the result is exact whatever the dtype (with one shard rank ``shard`` may have
    another dtype and is cast, round to nearest even). Called on every rank of the shard group.
    With ``async_op`` returns the work handle (``None`` if nothing is left to wait for).
    """
    if pm.shard_degree == 1:
        full.copy_(shard)
        return None
    record(acct, "all_gather", full, cross_node=pm.axis_spans_nodes(SHARD_AXIS))
    with collective_guard("all-gather of a flat group", pm):
        return all_gather_single(byte_view(full), byte_view(shard), pm.shard_group, async_op)


class PendingMean:
    """A gradient reduction in flight (:func:`start_reduce_scatter_mean`).

    :meth:`result` waits for the collective ``work`` (a failure there is a
    :class:`~shardckpt.errors.CollectiveError` naming ``what``), then runs ``finish`` (the
    rank-order sum, or the all-reduce over replicas, then the division by the world size), which
    returns this rank's fp32 mean slice; it is computed once. Until then the buffers the
    collective reads (``keep``) are kept alive here. Every rank must finish its pending
    reductions in the same order (the all-reduce over replicas is issued then).
    """

    __slots__ = ("_work", "_keep", "_what", "_pm", "_finish", "_value")

    def __init__(self, finish: Any, work: Any = None, keep: tuple[torch.Tensor, ...] = (),
                 what: str = "", pm: ProcessMesh | None = None) -> None:
        self._finish, self._work, self._keep, self._what, self._pm = finish, work, keep, what, pm
        self._value: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self._finish is None

    def result(self) -> torch.Tensor:
        if self._finish is not None:
            if self._work is not None:
                assert self._pm is not None  # every collective in flight is given its mesh
                with collective_guard(self._what, self._pm):
                    self._work.wait()
            self._work, self._keep = None, ()
            finish, self._finish = self._finish, None
            self._value = finish()
        assert self._value is not None
        return self._value


def reduce_scatter_mean(pm: ProcessMesh, grad: torch.Tensor, deterministic: bool,
                        sum_dtype: torch.dtype = FP32,
                        acct: Accounting | None = None) -> torch.Tensor:
    """This rank's slice of the mean of ``grad`` over all ranks, in fp32 (``s`` elements).

    ``grad`` is the full padded flat-group gradient (``S * s`` elements) of this rank. With
    ``deterministic`` the sum runs in global rank order in ``sum_dtype``, then divides by the
    world size (see the module docstring); otherwise the backend's reduce-scatter (and all-reduce
    over replicas) is used. Called on every rank of the world.
    """
    return start_reduce_scatter_mean(pm, grad, deterministic, sum_dtype, acct).result()


def start_reduce_scatter_mean(pm: ProcessMesh, grad: torch.Tensor, deterministic: bool,
                              sum_dtype: torch.dtype = FP32,
                              acct: Accounting | None = None) -> PendingMean:
    """:func:`reduce_scatter_mean`, issued asynchronously: the exchange runs on the backend's
    threads (on CUDA, its stream) while the caller goes on; :meth:`PendingMean.result` waits and
    gives the same bits as the synchronous call. ``grad`` must not be written until then."""
    S, W = pm.shard_degree, pm.world_size
    s = grad.numel() // S
    if W == 1:
        return PendingMean(lambda: grad.to(sum_dtype, copy=True).div_(W).to(FP32))
    if deterministic:
        return _start_ordered_mean(pm, grad, s, sum_dtype, acct)
    # Gloo has no bf16/fp16 reductions worth trusting; reduce in fp32 there.
    red = grad if (pm.backend == "nccl" or grad.dtype == FP32) else grad.to(FP32)
    out = torch.empty(s, dtype=red.dtype, device=red.device)
    work = None
    with collective_guard("reduce-scatter of a gradient", pm):
        if S > 1:
            record(acct, "reduce_scatter", red, cross_node=pm.axis_spans_nodes(SHARD_AXIS))
            work = _reduce_scatter_single(out, red, pm.shard_group, async_op=True)
        else:
            out.copy_(red)

    def finish() -> torch.Tensor:
        if pm.replicate_group is not None:
            with collective_guard("all-reduce of a gradient over replicas", pm):
                record(acct, "all_reduce", out, 2,
                       cross_node=pm.axis_spans_nodes(REPLICATE_AXIS))
                dist.all_reduce(out, op=dist.ReduceOp.SUM, group=pm.replicate_group)
        return out.to(FP32).div_(W) if out.dtype != FP32 else out.div_(W)

    # the collective reads grad/red until it is done
    return PendingMean(finish, work, (grad, red), "reduce-scatter of a gradient", pm)


def _start_ordered_mean(pm: ProcessMesh, grad: torch.Tensor, s: int,
                        sum_dtype: torch.dtype = FP32,
                        acct: Accounting | None = None) -> PendingMean:
    W, mesh = pm.world_size, pm.mesh
    if mesh.shard_degree == W:
        send = grad  # chunk r is already rank r's slice
    else:  # HSDP: every world rank j gets the slice of its shard rank
        send = torch.cat([grad[mesh.shard_rank(j) * s:(mesh.shard_rank(j) + 1) * s]
                          for j in range(W)])
    recv = torch.empty(W * s, dtype=grad.dtype, device=grad.device)
    record(acct, "all_to_all", send, cross_node=pm.world_spans_nodes)
    with collective_guard("ordered gradient exchange (all-to-all)", pm):
        work = dist.all_to_all_single(byte_view(recv), byte_view(send), group=pm.world_group,
                                      async_op=True)
    def finish() -> torch.Tensor:
        acc = recv[:s].to(sum_dtype, copy=True)
        for k in range(1, W):  # global rank order: ((g0 + g1) + g2) + ...
            acc.add_(recv[k * s:(k + 1) * s])
        return acc.div_(W).to(FP32)

    # the collective reads grad/send until it is done
    return PendingMean(finish, work, (grad, send), "ordered gradient exchange (all-to-all)", pm)


def all_gather_flat(pm: ProcessMesh, shard: torch.Tensor,
                    acct: Accounting | None = None) -> torch.Tensor:
    """The whole flat group (``S * s`` elements) from every shard rank's ``shard``; allocates."""
    full = torch.empty(shard.numel() * pm.shard_degree, dtype=shard.dtype, device=shard.device)
    all_gather_shard(pm, full, shard, acct=acct)
    return full


def all_reduce_shard_sum(pm: ProcessMesh, t: torch.Tensor,
                         acct: Accounting | None = None) -> torch.Tensor:
    """Sum ``t`` over the shard group, in place (replicas hold the same shards, so not over them)."""
    if pm.shard_degree > 1:
        record(acct, "all_reduce", t, 2, cross_node=pm.axis_spans_nodes(SHARD_AXIS))
        with collective_guard("all-reduce over the shard group", pm):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pm.shard_group)
    return t
