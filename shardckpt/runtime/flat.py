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
* the local gradient buffer (``precision.grad`` dtype, ``padded_numel`` elements) holds this
  rank's unreduced gradient from the first parameter gradient of a backward until the group is
  reduced (:attr:`local_grad`); backward passes without gradient sync (gradient accumulation) add
  into it. Padding stays zero. Every stage reduces it the same way, by
  :func:`~shardckpt.runtime.collectives.reduce_scatter_mean`.
* without ``resident_grad`` (ZeRO-2/3) the buffer is taken at the first gradient of an
  accumulation window, left uninitialized (each parameter's first gradient is copied in; what no
  parameter wrote, padding included, is zeroed just before the reduction) and given up once
  reduced: to the engine's :class:`GradBufferPool`, from which the next group of the same size
  takes it within the same backward (the pool is emptied at the end of each backward). The
  reduction can be left in flight (``reduce_grad(wait=False)``, then :meth:`finish_reduce`);
  ``grad`` is updated when it is finished. With ``resident_grad`` (ZeRO-1: gradients are not
  partitioned) it is :attr:`grad_buffer`: allocated once, kept for the life of the group and
  zeroed at the start of each accumulation window, so every rank holds a whole-size gradient
  buffer, as the ZeRO paper and :mod:`shardckpt.format.footprint_math` count it.
* ``grad`` (trained groups only) is ``None`` or the fp32 shard of the mean gradient over ranks,
  the same bits at every stage. With ``resident_grad`` and an fp32 gradient dtype, once reduced
  it is the view of the buffer's own ``[shard_start, shard_end)`` (the rest of the buffer then
  holds stale local gradients and means nothing); while a later backward of the same step writes
  the buffer, the mean accumulated so far is kept in a copy of ``s`` elements and put back into
  the buffer at the next reduction. Otherwise (no resident buffer, or a gradient dtype other than
  fp32) ``grad`` is a tensor of its own.
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
from shardckpt.runtime.gradpool import GradBufferPool
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.offload.master import (OffloadedMaster, master_tensor, set_shard,
                                              store_master)
from shardckpt.runtime.precision import GroupPrecision, resolve_precision, torch_dtype
from shardckpt.runtime.prefetch import CommStream, InFlight

__all__ = ["FlatParamGroup", "GradBufferPool", "point_params"]


class FlatParamGroup:
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

    @property
    def local_grad(self) -> torch.Tensor | None:
        """The local gradient buffer while it holds unreduced gradients, else ``None``."""
        return self._local_grad

    @property
    def grad_buffer(self) -> torch.Tensor | None:
        """The resident whole-size gradient buffer (``resident_grad``, once a backward has run;
        see the module docstring), else ``None``."""
        return self._grad_buffer

    def _grad_in_buffer(self) -> bool:
        """True if ``grad`` is the view of the resident buffer's own slice."""
        return (self.grad is not None and self._grad_buffer is not None
                and self.grad.untyped_storage().data_ptr()
                == self._grad_buffer.untyped_storage().data_ptr())

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

    # ---------------------------------------------------------------------- gradients

    def add_param_grad(self, index: int, grad: torch.Tensor) -> bool:
        """Put one parameter's local gradient into the flat buffer (copied the first time since
        the last reduction, added after that); True once all have arrived in this backward."""
        if self._local_grad is None:
            self.finish_reduce()  # a new accumulation window: the last reduction lands first
            self._local_grad = self._new_local_grad()
        spec = self.param_specs[index]
        with torch.no_grad():
            view = self._local_grad[spec.offset:spec.offset + spec.numel].view(spec.shape)
            if self._written[index]:
                view.add_(grad)
            else:
                view.copy_(grad)
                self._written[index] = True
        self._arrived += 1
        return self._arrived == len(self.params)

    def _new_local_grad(self) -> torch.Tensor:
        """A buffer for a new accumulation window: a fresh one left uninitialized (each
        parameter's first gradient is copied in, and :meth:`reduce_grad` zeroes what none
        wrote), or the resident one reused, zeroed."""
        if not self.resident_grad:
            return self.pool.take(self.spec.padded_numel, self.precision.grad,
                                  self.shard.device)
        if self._grad_buffer is None:
            self._grad_buffer = torch.zeros(self.spec.padded_numel, dtype=self.precision.grad,
                                            device=self.shard.device)
            return self._grad_buffer
        if self.grad is not None and self._grad_in_buffer():  # the mean so far must survive the new local gradients
            self.grad = self.grad.clone()
        with torch.no_grad():
            self._grad_buffer.zero_()
        return self._grad_buffer

    def end_backward(self) -> None:
        """Forget this backward's arrivals (an unreduced buffer keeps accumulating) and the hpZ
        copy."""
        self._arrived = 0
        self.drop_secondary()

    @property
    def has_pending_grad(self) -> bool:
        return self._local_grad is not None

    @property
    def reducing(self) -> bool:
        """True while a reduction started by ``reduce_grad(wait=False)`` is not finished."""
        return self._pending is not None

    def reduce_grad(self, deterministic: bool, wait: bool = True) -> None:
        """Reduce the local flat gradient into ``grad`` (adding to it) and release the buffer.

        Every stage reduce-scatters (:func:`~shardckpt.runtime.collectives.reduce_scatter_mean`),
        so ``grad`` gets the same bits whatever the stage. Without ``resident_grad`` the buffer is
        then freed; with it the buffer stays, and an fp32 ``grad`` moves into its own slice (see
        the module docstring). Collective: every rank calls it for the same groups in the same
        order. With ``wait=False`` the exchange is only issued (the backward goes on while it
        runs) and :meth:`finish_reduce` completes it; every rank finishes its reductions in the
        same order.
        """
        if self._local_grad is None:
            return
        self.finish_reduce()
        buf, self._local_grad = self._local_grad, None
        with torch.no_grad():  # what no parameter wrote is zero: padding, unused parameters
            if self.spec.numel < self.spec.padded_numel:
                buf[self.spec.numel:].zero_()
            for spec, written in zip(self.param_specs, self._written, strict=True):
                if not written:
                    buf[spec.offset:spec.offset + spec.numel].zero_()
        self._written = [False] * len(self.params)
        self._arrived = 0
        if self.zeropp is not None and self.zeropp.qgz:
            self._pending = zeropp.start_qgz_mean(self.pm, buf, self.zeropp.grad_bits,
                                                  self.zeropp.block_size, self.acct)
        else:
            self._pending = collectives.start_reduce_scatter_mean(
                self.pm, buf, deterministic, self.precision.sum, self.acct)
        self._pending_buf = None if self.resident_grad else buf
        del buf
        if wait:
            self.finish_reduce()

    def finish_reduce(self) -> None:
        """Wait for the reduction in flight, if any, and add its mean into ``grad``."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        buf, self._pending_buf = self._pending_buf, None
        reduced = pending.result()
        del pending
        if buf is not None:  # the collective is done with it: the next group may reuse it
            self.pool.give(buf)
            del buf
        if self.grad is None:
            self.grad = reduced
        else:
            self.grad.add_(reduced)
        del reduced
        if self.resident_grad and self._grad_buffer is not None \
                and self._grad_buffer.dtype == self.grad.dtype and not self._grad_in_buffer():
            with torch.no_grad():
                view = self._grad_buffer[self.shard_start:self.shard_end]
                view.copy_(self.grad)
            self.grad = view

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the reduced gradient (an unreduced accumulation buffer is dropped too; a
        resident buffer stays allocated)."""
        self._local_grad = None
        self._pending = None  # only left by a failed backward; the backend keeps its buffers
        self._pending_buf = None
        self._written = [False] * len(self.params)
        self._arrived = 0
        if set_to_none or self.grad is None:
            self.grad = None
        else:
            self.grad.zero_()


def point_params(params: Sequence[nn.Parameter], specs: Sequence[ParamSpec],
                 full: torch.Tensor) -> None:
    """Make each parameter's ``.data`` the view of its elements in the flat ``full``."""
    for p, spec in zip(params, specs, strict=True):
        p.data = full[spec.offset:spec.offset + spec.numel].view(spec.shape)
