"""The gradient side of a flat group: the local buffer a backward writes, its reduction into
``grad``, and the resident ZeRO-1 buffer. :class:`GroupGradients` is the part of
:class:`~shardckpt.runtime.flat.FlatParamGroup` that owns it (the gathers and the master shard are
in :mod:`shardckpt.runtime.flat`).

Invariants, on shard rank ``r`` (``s`` elements per shard):

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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardckpt.format.layout import FlatGroup, ParamSpec
from shardckpt.runtime import collectives
from shardckpt.runtime.accounting import Accounting
from shardckpt.runtime.gradpool import GradBufferPool
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.precision import GroupPrecision
from shardckpt.runtime.zeropp import comm as zeropp
from shardckpt.runtime.zeropp.options import ZeroPP

__all__ = ["GroupGradients"]


class GroupGradients:
    """The gradient state of one flat group (see the module docstring); the group's constructor
    sets every attribute declared here."""

    spec: FlatGroup
    param_specs: Sequence[ParamSpec]
    params: list[nn.Parameter]
    pm: ProcessMesh
    acct: Accounting
    pool: GradBufferPool
    precision: GroupPrecision
    resident_grad: bool
    shard: torch.Tensor
    shard_start: int
    shard_end: int
    zeropp: ZeroPP | None
    grad: torch.Tensor | None
    _grad_buffer: torch.Tensor | None
    _local_grad: torch.Tensor | None
    _pending: collectives.PendingMean | None
    _pending_buf: torch.Tensor | None
    _written: list[bool]
    _arrived: int

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
