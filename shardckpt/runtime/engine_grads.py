"""What a training loop does with an engine's gradients between backward and step: clear them,
accumulate without reducing (:meth:`GradientControls.no_sync`), check that none were left
unreduced, clip them. :class:`GradientControls` is that part of
:class:`~shardckpt.runtime.engine.ZeroEngine`; the hooks that produce the gradients are in
:mod:`shardckpt.runtime.stages` and each flat group's buffers in :mod:`shardckpt.runtime.flat_grads`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from shardckpt.errors import ConfigError
from shardckpt.runtime.accounting import Accounting
from shardckpt.runtime.clipping import clip_grad_shards
from shardckpt.runtime.contracts import ReductionListener
from shardckpt.runtime.flat import FlatParamGroup
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.stages import StageSchedule

__all__ = ["GradientControls"]


class GradientControls:
    """The gradient controls of a :class:`~shardckpt.runtime.engine.ZeroEngine`; the engine's
    constructor sets every attribute declared here."""

    groups: dict[str, FlatParamGroup]
    process_mesh: ProcessMesh
    accounting: Accounting
    _params: dict[str, nn.Parameter]
    _listener: ReductionListener | None
    _schedule: StageSchedule

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the reduced gradients, any unreduced accumulation, and any stray ``.grad``."""
        if self._listener is not None:
            self._listener.before_grads_change()
        for g in self.groups.values():
            g.zero_grad(set_to_none)
        if self._schedule.pool is not None:
            self._schedule.pool.clear()
        for p in self._params.values():
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local, unsharded gradients and reduce nothing.

        The next backward outside reduces the sum of all of them once (DDP/FSDP ``no_sync``): one
        reduction per accumulation window instead of one per micro-batch, at the cost of holding
        each trained group's whole gradient. The sum runs in the gradient dtype of the group
        (the policy's ``reduce_dtype``; without a policy, the parameter's dtype). Without
        ``no_sync`` every backward reduces and the fp32 means add up. Enter it on every rank
        alike.
        """
        previous = self._schedule.sync_grads
        self._schedule.sync_grads = False
        try:
            yield
        finally:
            self._schedule.sync_grads = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's spelling of :meth:`no_sync`: ``False`` until the last micro-batch."""
        self._schedule.sync_grads = bool(requires_gradient_sync)

    def check_grads_reduced(self) -> None:
        """Raise if a backward under :meth:`no_sync` left gradients that were never reduced."""
        pending = [name for name, g in self.groups.items() if g.has_pending_grad]
        if pending:
            raise ConfigError(
                f"{len(pending)} flat groups ({', '.join(pending[:3])}...) hold gradients of "
                "backward passes run without gradient sync that were never reduced; run the last "
                "micro-batch's backward outside no_sync() before clipping or stepping")

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> float:
        """Scale the reduced gradient shards so that their global L2 norm is at most ``max_norm``.

        Returns the norm before clipping. Same rule as ``torch.nn.utils.clip_grad_norm_``
        (coefficient ``max_norm / (norm + eps)``, capped at 1), but the squares are summed per
        shard (in fp64), then over the shard group (replicas hold the same shards), so the norm
        is not bit-exact against an unsharded one. Every element counts once whatever the stage
        (each rank holds only its shard of the reduced gradient, stage 1 included). Collective:
        call on every rank, between ``backward()`` and ``step()``.
        """
        self.check_grads_reduced()
        if self._listener is not None:
            self._listener.before_grads_change()
        norm, coef = clip_grad_shards(self.groups.values(), self.process_mesh, self.accounting,
                                      max_norm, eps)
        if self._listener is not None:  # the offloaded step's host copies, alike (refused if stepped)
            self._listener.grads_scaled(coef)
        return float(norm)
