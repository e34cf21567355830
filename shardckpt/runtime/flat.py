"""One flat group at run time: the master shard, the gathered buffer, and the gradient on its way out.

Invariants of a :class:`FlatParamGroup` on shard rank ``r`` (``s = layout.shard_numel(group)``):

* ``master`` is 1-D, ``s`` elements, ``group.master_dtype`` (fp32 if trained, the param's dtype if
  frozen); ``master[i]`` is element ``r * s + i`` of the flat group. Padding elements are zero.
  ``shard`` is what gathers read: ``master``, or with the optimizer offloaded and a narrower
  compute dtype the compute shard alone, ``master`` being ``None``
  (:mod:`shardckpt.runtime.offload.master`).
* the compute dtype (``precision.compute``: the declared dtype, or a mixed-precision policy's
  ``param_dtype``) is what all-gathers move: ``master`` itself when the dtypes agree, else a copy
  cast (round to nearest even) at gather time and dropped once the all-gather is done, so no
  compute-dtype shard stays resident (as in FSDP2; :attr:`compute` shows it).
* ``full`` is 1-D with ``padded_numel`` elements in the compute dtype. Its storage holds 0 bytes
  unless the group is gathered. While gathered, each parameter's ``.data`` is a view of its
  ``[offset, offset + numel)`` elements; otherwise a 0-element placeholder. Autograd's saved views
  keep pointing at the same storage object, which a re-gather refills. A gather may be in flight
  (:meth:`start_gather`, prefetch): then ``full`` is allocated but undefined until
  :meth:`wait_gather`, and :meth:`free` waits for it before releasing the storage.
* the gradient path (the local gradient buffer, its reduction, ``grad``):
  :mod:`shardckpt.runtime.flat_grads`, whose :class:`~shardckpt.runtime.flat_grads.GroupGradients`
  this class extends.
* ZeRO++ (:mod:`shardckpt.runtime.zeropp`, set by the engine; its collectives are
  :mod:`~shardckpt.runtime.zeropp.comm`): with qwZ a gather moves the int8
  master shard and fills ``full`` with the dequantized weights once waited for; with hpZ a
  forward's gather (gradients enabled) keeps this rank's ``1/K`` slice of ``full``
  (:attr:`secondary`) and every later gather runs inside the node from it, until the end of the
  backward or the masters change; with qgZ the reduction is the quantized hierarchical one.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import torch
from torch import nn

from shardckpt.errors import ConfigError
from shardckpt.format.layout import FlatGroup, Layout, ParamSpec
from shardckpt.runtime import collectives
from shardckpt.runtime.zeropp import comm as zeropp
from shardckpt.runtime.zeropp.options import ZeroPP
from shardckpt.runtime.accounting import Accounting
from shardckpt.runtime.flat_grads import GroupGradients
from shardckpt.runtime.gradpool import GradBufferPool
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.offload.master import (OffloadedMaster, master_tensor, set_shard,
                                              store_master)
from shardckpt.runtime.precision import GroupPrecision, resolve_precision, torch_dtype
from shardckpt.runtime.prefetch import CommStream, InFlight

__all__ = ["FlatParamGroup", "GradBufferPool", "point_params"]


class FlatParamGroup(GroupGradients):
    """Runtime state of one :class:`~shardckpt.format.layout.FlatGroup` on this rank (see module docstring)."""

    def __init__(self, spec: FlatGroup, layout: Layout, params: Sequence[nn.Parameter],
                 pm: ProcessMesh, acct: Accounting | None = None,
                 comm: CommStream | None = None, resident_grad: bool = False,
                 pool: GradBufferPool | None = None) -> None:
        self.spec = spec
        self.pool = pool if pool is not None else GradBufferPool()
        self.resident_grad = resident_grad  # ZeRO-1: keep the whole gradient buffer
        self.pm = pm
        self.acct = acct if acct is not None else Accounting()
        self.comm = comm if comm is not None else CommStream(pm.device)
        self._inflight: InFlight | None = None
        self.param_specs = layout.group_params(spec)
        self.params = list(params)
        if len(self.params) != len(self.param_specs):
            raise ConfigError(f"flat group {spec.name} has {len(self.param_specs)} specs but "
                              f"{len(self.params)} parameters")
        self.dtype = torch_dtype(spec.dtype)
        self.precision: GroupPrecision = resolve_precision(None, self.dtype)
        self.shard_numel = layout.shard_numel(spec)
        self.shard_start, self.shard_end = layout.shard_range(spec, pm.shard_rank)
        self.shard = self.master = torch.zeros(  # ``master``: ``None`` once offloaded
            self.shard_numel, dtype=torch_dtype(spec.master_dtype), device=pm.device)
        self.offloaded: OffloadedMaster | None = None
        # set whenever ``master`` may have changed outside an offloaded step (the offload store
        # copies it in before the next step; :mod:`shardckpt.runtime.offload`)
        self.master_changed = True
        self._make_compute_buffers()
        self.gathered = False
        self.grad: torch.Tensor | None = None
        self._grad_buffer: torch.Tensor | None = None  # resident_grad only
        self._local_grad: torch.Tensor | None = None
        self._pending: collectives.PendingMean | None = None  # a reduction in flight
        self._pending_buf: torch.Tensor | None = None  # the pool-owned buffer it reads
        self._written = [False] * len(self.params)
        self._arrived = 0
        # ZeRO++ (set by the engine): the options, and whether this group keeps an hpZ copy
        self.zeropp: ZeroPP | None = None
        self.hpz = False
        self._secondary: torch.Tensor | None = None  # hpZ: this rank's in-node slice of full
        self._keep_secondary = False  # the gather in flight is a forward's: keep a slice
        self._post_gather: Any = None  # qwZ: dequantize into full once the gather is done

    def set_precision(self, precision: GroupPrecision) -> None:
        """Switch the compute dtype (and gradient dtypes); only while freed, before training."""
        if (self.gathered or self._local_grad is not None or self.grad is not None
                or self._pending is not None):
            raise ConfigError(f"flat group {self.name}: precision changes only while freed")
        self.precision = precision
        self._grad_buffer = None  # reallocated in the new gradient dtype by the next backward
        self.dtype = precision.compute
        self._make_compute_buffers()
        for p in self.params:
            p.data = self._placeholder
        self.refresh()

    def _make_compute_buffers(self) -> None:
        """The (freed) ``full`` and the placeholder, in ``self.dtype``."""
        device = self.shard.device
        self.full = torch.empty(self.spec.padded_numel, dtype=self.dtype, device=device)
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self._placeholder = torch.empty(0, dtype=self.dtype, device=device)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def trainable(self) -> bool:
        return self.spec.requires_grad

    @property
    def compute(self) -> torch.Tensor:
        """This rank's shard in the compute dtype: ``shard`` itself, or a fresh cast of it."""
        return self.shard if self.shard.dtype == self.dtype else self.shard.to(self.dtype)

    # ------------------------------------------------------------------ gather / free

    def allocate(self) -> None:
        """Give ``full`` its storage back (contents undefined) and point the params into it."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self._full_nbytes)
            self.acct.allocated(self._full_nbytes)
            self._point_params()
            self.gathered = True

    def start_gather(self) -> None:
        """Issue the all-gather of the compute shards into ``full`` and return without waiting
        (idempotent). ``full`` is undefined until :meth:`wait_gather`. Collective."""
        if self.gathered:
            return
        self.allocate()
        zpp = self.zeropp
        with torch.no_grad(), self.comm.issue():
            if self._secondary is not None:  # hpZ: the forward's weights, from inside the node
                keep: tuple[torch.Tensor, ...] = (self._secondary,)
                work = zeropp.start_node_gather(self.pm, self.full, self._secondary, self.acct)
            elif zpp is not None and zpp.qwz and self.dtype.is_floating_point:
                work, keep, self._post_gather = zeropp.start_quantized_gather(
                    self.pm, self.full, self.master, zpp.block_size, self.acct)
            else:
                # One shard rank: copy_ casts straight into ``full``; else cast once for the wire.
                src = self.shard if self.pm.shard_degree == 1 else self.compute
                keep = (src,)
                work = collectives.all_gather_shard(self.pm, self.full, src, async_op=True,
                                                    acct=self.acct)
        self._keep_secondary = (self.hpz and self._secondary is None
                                and torch.is_grad_enabled() and not zeropp.in_backward())
        self._inflight = InFlight(work, keep, self.comm.stream)

    def wait_gather(self) -> None:
        """Wait for an all-gather started by :meth:`start_gather` (no-op if none is in flight)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            with collectives.collective_guard("all-gather of a flat group", self.pm):
                inflight.wait()
            finish, self._post_gather = self._post_gather, None
            if finish is not None:
                with torch.no_grad():
                    finish()
            if self._keep_secondary:  # hpZ: keep this rank's 1/K slice for the backward
                self._keep_secondary = False
                self._secondary = zeropp.node_slice(self.pm, self.full)
                self.acct.secondary(self._secondary.untyped_storage().nbytes())

    def drop_secondary(self) -> None:
        """Forget the hpZ copy (end of backward, or the masters changed)."""
        if self._secondary is not None:
            self.acct.secondary(-self._secondary.untyped_storage().nbytes())
            self._secondary = None

    @property
    def secondary(self) -> torch.Tensor | None:
        """The hpZ secondary copy held now, if any."""
        return self._secondary

    def end_backward(self) -> None:
        """Forget this backward's arrivals (an unreduced buffer keeps accumulating) and the hpZ
        copy."""
        self._arrived = 0
        self.drop_secondary()

    def gather(self) -> None:
        """All-gather the compute shards from every shard rank into ``full``. Collective;
        idempotent; waits for a prefetched gather."""
        self.start_gather()
        self.wait_gather()

    def free(self) -> None:
        """Drop the non-owned part: params become placeholders and ``full`` holds no bytes."""
        if not self.gathered:
            return
        self.wait_gather()  # never release a buffer a collective still writes into
        for p in self.params:
            p.data = self._placeholder
        self.full.untyped_storage().resize_(0)
        self.acct.released(self._full_nbytes)
        self.gathered = False

    def _point_params(self) -> None:
        point_params(self.params, self.param_specs, self.full)

    def repoint(self) -> None:
        """Point the params at ``full`` if gathered, else at the placeholder (after a summon)."""
        if self.gathered:
            self._point_params()
        else:
            for p in self.params:
                p.data = self._placeholder

    def shard_from_full(self, full: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of ``full`` (default: the gathered buffer) into ``master``,
        then re-derive ``compute``. Local; padding stays zero."""
        if full is None:
            self.wait_gather()
        full = self.full if full is None else full
        with torch.no_grad():
            master = master_tensor(self)
            master.copy_(full[self.shard_start:self.shard_end])
            pad_from = max(0, self.spec.numel - self.shard_start)
            if pad_from < self.shard_numel:  # padding means nothing and is zero
                master[pad_from:].zero_()
        store_master(self, master)

    def refresh(self, reload: bool = False) -> None:
        """Re-derive the compute shard from the master: cast from ``master`` at each gather, or
        with ``reload`` cast from the store's into ``shard``; an hpZ copy is dropped."""
        self.master_changed = True
        if reload and self.offloaded is not None:
            set_shard(self, self.offloaded.read())
        self.drop_secondary()



def point_params(params: Sequence[nn.Parameter], specs: Sequence[ParamSpec],
                 full: torch.Tensor) -> None:
    """Make each parameter's ``.data`` the view of its elements in the flat ``full``."""
    for p, spec in zip(params, specs, strict=True):
        p.data = full[spec.offset:spec.offset + spec.numel].view(spec.shape)
